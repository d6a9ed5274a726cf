"""The serving floor: queue policies (scheduler.py) and a discrete-event simulator of a
non-preemptive server (simulator.py) now; engines over slots, the OpenAI-compatible HTTP
server and the Colab chat model later. The simulator and the live server share scheduler.py.
"""
