"""The SyntheticChat word lists: the data tables the grammar is built from.

Topic lists are disjoint from each other and from the generic content lists (the grammar checks
this when it is built). Changing any list changes the language, and with it the corpus.
"""

from __future__ import annotations

USER = "<user>"
ASSISTANT = "<assistant>"
UNK = "<unk>"

# --------------------------------------------------------------------------
# Hand-written word lists. Topic lists are disjoint from each other and from
# the generic content lists (checked at construction).
# --------------------------------------------------------------------------

# topic -> (nouns, verbs, adjectives)
TOPICS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "weather": (
        ["rain", "snow", "wind", "storm", "cloud", "sun", "forecast", "temperature", "humidity", "thunder", "fog", "umbrella", "climate", "degrees", "drizzle", "hail"],
        ["rains", "snows", "pours", "freezes", "shines", "blows"],
        ["sunny", "cloudy", "windy", "rainy", "humid", "chilly"],
    ),
    "food": (
        ["recipe", "pasta", "bread", "rice", "soup", "salad", "cheese", "garlic", "oven", "kitchen", "dinner", "breakfast", "sauce", "spice", "dessert", "flavor"],
        ["bake", "cook", "boil", "fry", "taste", "chop"],
        ["delicious", "spicy", "sweet", "salty", "fresh", "crispy"],
    ),
    "travel": (
        ["flight", "airport", "hotel", "passport", "luggage", "ticket", "beach", "city", "museum", "train", "journey", "visa", "itinerary", "map", "tourist", "destination"],
        ["fly", "visit", "pack", "explore", "book", "wander"],
        ["scenic", "cheap", "crowded", "exotic", "remote", "historic"],
    ),
    "music": (
        ["song", "guitar", "piano", "melody", "rhythm", "album", "concert", "band", "singer", "chord", "lyrics", "drum", "playlist", "tempo", "orchestra", "harmony"],
        ["sing", "strum", "compose", "listen", "tune", "rehearse"],
        ["catchy", "loud", "acoustic", "melodic", "classical", "jazzy"],
    ),
    "sports": (
        ["team", "match", "goal", "coach", "player", "ball", "league", "stadium", "score", "referee", "tournament", "training", "fans", "racket", "field", "medal"],
        ["kick", "throw", "win", "lose", "sprint", "tackle"],
        ["athletic", "competitive", "fast", "defensive", "olympic", "sporty"],
    ),
    "code": (
        ["function", "variable", "compiler", "bug", "loop", "array", "python", "server", "database", "syntax", "library", "module", "test", "commit", "api", "debugger"],
        ["compile", "debug", "refactor", "deploy", "import", "iterate"],
        ["recursive", "binary", "async", "static", "buggy", "modular"],
    ),
    "health": (
        ["sleep", "exercise", "diet", "doctor", "vitamin", "fever", "muscle", "heart", "stress", "water", "protein", "symptom", "medicine", "nurse", "clinic", "posture"],
        ["rest", "stretch", "heal", "breathe", "recover", "hydrate"],
        ["healthy", "tired", "sore", "calm", "balanced", "chronic"],
    ),
    "movies": (
        ["film", "movie", "actor", "director", "scene", "plot", "sequel", "cinema", "trailer", "genre", "script", "character", "popcorn", "screen", "comedy", "drama"],
        ["watch", "stream", "binge", "premiere", "review", "rewatch"],
        ["thrilling", "funny", "animated", "dramatic", "scary", "cinematic"],
    ),
}
TOPIC_NAMES: tuple[str, ...] = tuple(TOPICS)

DET = ["the", "a", "this", "that", "some", "your", "my", "our", "every", "each", "many", "most", "any", "these", "those", "their", "its", "no"]
GEN_NOUN = (
    ["thing", "things", "way", "time", "people", "idea", "part", "place", "day", "week", "year", "kind", "lot", "problem", "option", "choice", "reason", "plan", "step", "result", "friend", "home", "work"]
)
GEN_VERB = (
    ["is", "are", "was", "can", "will", "helps", "makes", "takes", "needs", "gets", "feels", "seems", "works", "means", "has", "goes", "keeps", "gives", "try", "use", "find", "change"]
)
GEN_ADJ = (
    ["good", "bad", "great", "new", "old", "big", "small", "best", "better", "simple", "hard", "easy", "important", "different", "common", "popular", "nice", "useful", "main", "real", "usual"]
)
ADV = (
    ["usually", "generally", "often", "sometimes", "really", "maybe", "probably", "definitely", "always", "never", "also", "however", "just", "very", "quite", "still", "actually", "typically"]
)
CONN = ["and", "but", "or", "so", "because", "with", "in", "on", "for", "of", "to", "at", "from", "about", "when", "if", "then", "while", "after", "before", "by", "than", "into", "over"]
OPENER = (
    ["hi", "hello", "hey", "so", "ok", "please", "what", "how", "why", "when", "where", "which", "can", "could", "would", "should", "do", "does", "tell", "me", "i", "you", "question", "help", "wondering", "curious", "know", "want", "need"]
)
# Verbosity cue words, class 0 (short) .. class 3 (very long).
CUES = (
    ["briefly", "quick", "quickly", "short", "concise", "simply", "tldr", "shortly"],
    ["describe", "overview", "summarize", "outline", "sketch", "basics", "summary", "gist"],
    ["explain", "detail", "details", "thoroughly", "carefully", "deeply", "reasoning", "why"],
    ["everything", "comprehensive", "exhaustive", "complete", "guide", "elaborate", "thorough", "tutorial"],
)
TAIL = ["please", "thanks", "now", "today", "again", "too", "here", "anyway"]

OPEN_PHRASES = [
    "sure", "of course", "great question", "good question", "thank you for asking",
    "happy to help", "here is what i know", "let me explain", "well", "okay so",
]
MID_PHRASES = [
    "for example", "on the other hand", "in other words", "as a result", "it depends on",
    "the key is", "in general", "keep in mind that", "to be honest", "first of all",
    "after that",
]
CLOSE_PHRASES = [
    "hope that helps", "i hope this helps", "let me know if you need anything else",
    "feel free to ask more", "thank you for asking", "have a nice day", "good luck",
    "enjoy", "that is all",
]

# Syntax of content words: sub-states and the Markov chain between them
# (conditional on the body continuing). Rows sum to 1.
SYN = ("DET", "ADJ", "NOUN", "VERB", "ADV", "CONN")
SYN_ENTRY = {"DET": 0.45, "NOUN": 0.3, "ADV": 0.15, "ADJ": 0.1}
SYN_TRANS = {
    "DET": {"ADJ": 0.3, "NOUN": 0.7},
    "ADJ": {"NOUN": 0.75, "ADJ": 0.1, "CONN": 0.15},
    "NOUN": {"VERB": 0.45, "CONN": 0.35, "NOUN": 0.1, "ADV": 0.1},
    "VERB": {"DET": 0.45, "ADJ": 0.15, "ADV": 0.15, "CONN": 0.15, "NOUN": 0.1},
    "ADV": {"VERB": 0.4, "ADJ": 0.4, "DET": 0.2},
    "CONN": {"DET": 0.5, "NOUN": 0.3, "ADV": 0.2},
}
# Topic share of each content category: (topic words, generic words, other topics).
TOPIC_SHARE = {"NOUN": 0.7, "VERB": 0.35, "ADJ": 0.4}
