"""Generate the bundled sample dataset (data/sample/), written for this project.

    python -m tuneloop.data.sample --out data/sample

rebuilds data/sample/train.jsonl and data/sample/README.md byte for byte: every choice
comes from one seeded random generator, and rows are written in a fixed key order.

The tasks are small on purpose. The default base model is a tiny GPT-2 (4 layers, 128
wide) pre-trained briefly on Python docs: it knows next to nothing, so most tasks are ones
a few hundred fine-tuning steps can visibly teach -- the answer follows from a rule or a
word list visible in the prompt -- and every answer is a single word or number, so exact
match is a meaningful score. Labels of the two classification tasks are balanced. Every
prompt is distinct, so a split cannot leak a prompt from train into eval. No names, no personal
data, no secrets: the reviews are assembled from the word lists below.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

SEED = 20240601
SYSTEM_PROMPT = "You are a concise assistant. Reply with a single word or number."

POSITIVE = ["great", "excellent", "sturdy", "reliable", "comfortable", "lovely", "fantastic",
            "solid", "useful", "handy", "quiet", "fast", "perfect", "wonderful", "sleek",
            "durable", "elegant", "pleasant", "superb", "brilliant"]
NEGATIVE = ["broken", "flimsy", "shoddy", "noisy", "slow", "useless", "awful", "terrible",
            "faulty", "weak", "ugly", "uncomfortable", "disappointing", "leaky", "dull",
            "fragile", "poor", "horrible", "clunky", "defective"]
POSITIVE_ENDINGS = ["I would buy it again.", "Highly recommended.", "Worth every penny.",
                    "We use it every day.", "Five stars.", "Very happy with it."]
NEGATIVE_ENDINGS = ["I sent it back.", "Do not buy it.", "A waste of money.",
                    "It stopped working in a week.", "One star.", "Very unhappy with it."]
PRODUCTS = ["lamp", "kettle", "backpack", "blender", "charger", "keyboard", "umbrella",
            "toaster", "headset", "chair", "jacket", "mug", "fan", "speaker", "drill",
            "pillow", "watch", "tent", "bottle", "printer"]
OPENERS = ["The", "This", "My new", "Our"]

WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
AFTER = ["What day comes after {d}?", "Which day follows {d}?", "What is the day after {d}?",
         "If today is {d}, what day is tomorrow?"]
BEFORE = ["What day comes before {d}?", "Which day precedes {d}?", "What is the day before {d}?",
          "If today is {d}, what day was yesterday?"]

OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("left", "right"),
             ("open", "closed"), ("light", "dark"), ("happy", "sad"), ("early", "late"),
             ("full", "empty"), ("hard", "soft"), ("high", "low"), ("long", "short"),
             ("old", "new"), ("rich", "poor"), ("wet", "dry"), ("strong", "weak"),
             ("thick", "thin"), ("loud", "quiet"), ("clean", "dirty"), ("true", "false"),
             ("win", "lose"), ("push", "pull"), ("buy", "sell"), ("inside", "outside"),
             ("before", "after"), ("first", "last"), ("start", "finish"), ("day", "night"),
             ("near", "far"), ("heavy", "light"), ("cheap", "expensive"), ("safe", "dangerous"),
             ("sweet", "sour"), ("wide", "narrow"), ("deep", "shallow"), ("young", "old"),
             ("north", "south"), ("east", "west"), ("above", "below"), ("always", "never"),
             ("more", "less"), ("add", "remove"), ("accept", "reject"), ("friend", "enemy"),
             ("question", "answer"), ("on", "off"), ("yes", "no"), ("in", "out"), ("come", "go")]

NOUNS = {  # singular -> plural; mostly regular (+s, +es, y -> ies), a few irregular
    "cat": "cats", "dog": "dogs", "book": "books", "tree": "trees", "car": "cars",
    "house": "houses", "bird": "birds", "apple": "apples", "chair": "chairs", "table": "tables",
    "door": "doors", "window": "windows", "river": "rivers", "cloud": "clouds", "flower": "flowers",
    "pen": "pens", "cup": "cups", "hat": "hats", "shoe": "shoes", "road": "roads",
    "star": "stars", "boat": "boats", "train": "trains", "lamp": "lamps", "song": "songs",
    "bag": "bags", "coin": "coins", "egg": "eggs", "key": "keys", "ring": "rings",
    "desk": "desks", "horse": "horses", "phone": "phones", "plant": "plants", "rock": "rocks",
    "shirt": "shirts", "sock": "socks", "spoon": "spoons", "stone": "stones", "wall": "walls",
    "box": "boxes", "fox": "foxes", "bus": "buses", "dish": "dishes", "brush": "brushes",
    "church": "churches", "watch": "watches", "glass": "glasses", "class": "classes", "match": "matches",
    "bench": "benches", "wish": "wishes", "tax": "taxes", "kiss": "kisses", "beach": "beaches",
    "lunch": "lunches", "dress": "dresses", "peach": "peaches", "bush": "bushes", "branch": "branches",
    "city": "cities", "baby": "babies", "party": "parties", "story": "stories", "lady": "ladies",
    "country": "countries", "family": "families", "berry": "berries", "puppy": "puppies", "penny": "pennies",
    "cherry": "cherries", "fly": "flies", "army": "armies", "body": "bodies", "copy": "copies",
    "hobby": "hobbies", "lily": "lilies", "pony": "ponies", "duty": "duties", "study": "studies",
    "child": "children", "mouse": "mice", "tooth": "teeth", "foot": "feet", "man": "men",
    "woman": "women", "goose": "geese", "person": "people", "ox": "oxen", "leaf": "leaves",
    "knife": "knives", "wolf": "wolves", "half": "halves", "shelf": "shelves", "loaf": "loaves",
    "potato": "potatoes", "tomato": "tomatoes", "hero": "heroes", "echo": "echoes", "sheep": "sheep",
}

UPPERCASE_WORDS = ["apple", "river", "green", "table", "music", "cloud", "stone", "paper", "light",
                   "happy", "bread", "water", "chair", "plant", "smile", "train", "house", "money",
                   "night", "ocean", "tiger", "lemon", "piano", "sugar", "clock", "dream", "grass",
                   "honey", "juice", "knife", "metal", "north", "peace", "queen", "radio", "salad",
                   "sheep", "snake", "storm", "sword", "tooth", "tower", "voice", "whale", "wheel",
                   "world", "zebra", "badge", "cabin", "daisy", "eagle", "fence", "ghost", "horse",
                   "image", "jelly", "karma", "llama", "mango", "novel", "olive", "pearl", "quilt",
                   "robot", "scarf", "toast", "uncle", "vivid", "wagon", "yacht", "blue", "red",
                   "cat", "dog", "sun", "moon", "tree", "book", "fish", "bird", "road", "rain",
                   "snow", "fire", "wind", "gold", "milk", "salt", "rice", "corn", "door", "lake",
                   "hill", "king", "ship", "star", "frog", "duck", "bell", "coat"]


def _chat(user: str, answer: str) -> dict:
    return {"messages": [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ]}


def _review(rng: random.Random, words: list[str], endings: list[str]) -> str:
    a, b = rng.sample(words, 2)
    return f"{rng.choice(OPENERS)} {rng.choice(PRODUCTS)} is {a} and {b}. {rng.choice(endings)}"


def sentiment(rng: random.Random, per_label: int = 150) -> list[tuple[str, str, str]]:
    rows = []
    for label, words, endings in (("positive", POSITIVE, POSITIVE_ENDINGS),
                                  ("negative", NEGATIVE, NEGATIVE_ENDINGS)):
        reviews: set[str] = set()
        while len(reviews) < per_label:
            reviews.add(_review(rng, words, endings))
        for review in sorted(reviews):
            rows.append(("sentiment", f"Is this review positive or negative?\nReview: {review}", label))
    return rows


def even_or_odd(rng: random.Random, per_label: int = 70) -> list[tuple[str, str, str]]:
    evens = rng.sample(range(2, 200, 2), per_label)
    odds = rng.sample(range(1, 200, 2), per_label)
    return [("even_odd", f"Is {n} even or odd?", "even" if n % 2 == 0 else "odd") for n in evens + odds]


def larger(rng: random.Random, n: int = 140) -> list[tuple[str, str, str]]:
    pairs: list[tuple[int, int]] = []
    seen: set[frozenset[int]] = set()
    while len(pairs) < n:
        a, b = rng.sample(range(1, 100), 2)
        if frozenset((a, b)) in seen:
            continue
        seen.add(frozenset((a, b)))
        # Half the rows put the larger number first, so position tells nothing.
        big, small = max(a, b), min(a, b)
        pairs.append((big, small) if len(pairs) % 2 == 0 else (small, big))
    return [("larger", f"Which number is larger, {a} or {b}?", str(max(a, b))) for a, b in pairs]


def next_number(rng: random.Random, n: int = 140) -> list[tuple[str, str, str]]:
    return [("next_number", f"What number comes after {k}?", str(k + 1)) for k in rng.sample(range(1, 200), n)]


def addition(rng: random.Random, n: int = 140) -> list[tuple[str, str, str]]:
    pairs = rng.sample([(a, b) for a in range(13) for b in range(13)], n)
    return [("addition", f"What is {a} + {b}?", str(a + b)) for a, b in pairs]


def weekdays() -> list[tuple[str, str, str]]:
    rows = []
    for i, d in enumerate(WEEKDAYS):
        rows += [("weekday", t.format(d=d), WEEKDAYS[(i + 1) % 7]) for t in AFTER]
        rows += [("weekday", t.format(d=d), WEEKDAYS[(i - 1) % 7]) for t in BEFORE]
    return rows


def opposites() -> list[tuple[str, str, str]]:
    rows = []
    for a, b in OPPOSITES:
        rows.append(("opposite", f"What is the opposite of {a}?", b))
        rows.append(("opposite", f"What is the opposite of {b}?", a))
    # "light" and "old" each have two opposites above: keep the first, so every prompt has one answer.
    unique: dict[str, tuple[str, str, str]] = {}
    for row in rows:
        unique.setdefault(row[1], row)
    return list(unique.values())


def plurals() -> list[tuple[str, str, str]]:
    return [("plural", f"What is the plural of {s}?", p) for s, p in NOUNS.items()]


def uppercase() -> list[tuple[str, str, str]]:
    return [("uppercase", f"Write {w} in capital letters.", w.upper()) for w in UPPERCASE_WORDS]


def generate(seed: int = SEED) -> list[tuple[str, str, str]]:
    """All rows as (task, user prompt, answer), in the order they are written."""
    rng = random.Random(seed)
    rows = (sentiment(rng) + even_or_odd(rng) + larger(rng) + next_number(rng) + addition(rng)
            + weekdays() + opposites() + plurals() + uppercase())
    prompts = Counter(prompt for _, prompt, _ in rows)
    duplicates = [p for p, n in prompts.items() if n > 1]
    assert not duplicates, f"duplicate prompts in the sample: {duplicates[:3]}"
    rng.shuffle(rows)
    return rows


# Traffic the sample set never had: longer, multi-sentence requests on other topics (trip
# planning, cooking, home repairs, software). The demo sends these to show the monitoring
# flow catching a topic shift (tuneloop/demo.py); they are not training data.
CITIES = ["Lisbon", "Kyoto", "Oslo", "Quebec", "Porto", "Seville", "Bergen", "Krakow", "Valencia", "Tallinn"]
MONTHS = ["March", "April", "May", "June", "September", "October", "November"]
LIKES = ["old churches", "street food", "long walks", "small museums", "live music", "markets",
         "bike rides", "quiet beaches", "bookshops", "gardens"]
DISHES = ["a lentil soup", "a mushroom risotto", "a lemon cake", "flatbreads", "a vegetable curry",
          "a tomato sauce", "pancakes", "a bean stew"]
REPAIRS = ["a dripping kitchen tap", "a squeaky door hinge", "a cracked bathroom tile",
           "a window that will not close", "a wobbly table leg", "a blocked shower drain"]
TOOLS = ["a Python script", "a shell script", "a spreadsheet macro", "a small web page", "a SQL query"]
GOALS = ["rename a few hundred photos by date", "merge two address lists", "count words in text files",
         "back up a folder every night", "find duplicate rows in a table"]
SHIFTED = [
    "I am planning a trip to {city} in {month} with {k} friends. We enjoy {a} and {b}. Could you "
    "suggest a plan for {d} days, and tell us what to pack and how to get around?",
    "My family wants to cook {dish} for {k} guests this weekend, but one of them cannot eat nuts "
    "and another avoids dairy. Which ingredients should we swap, and how long will it take?",
    "There is {repair} in our flat and the landlord is away for {d} days. What tools do I need, "
    "what should I check first, and when is it better to call a professional?",
    "At work I need {tool} that can {goal}. I have never written one before. Can you explain the "
    "steps, what could go wrong, and how I should test it before using it on real files?",
    "We are visiting {city} in {month} and would like to see {a} without big crowds. Which days "
    "of the week are calmer, and is it worth buying a {d}-day travel pass?",
]


def shifted_prompts(n: int, seed: int = 1) -> list[str]:
    """n distinct user messages unlike the sample set (see SHIFTED), for the demo's drift."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        a, b = rng.sample(LIKES, 2)
        text = rng.choice(SHIFTED).format(city=rng.choice(CITIES), month=rng.choice(MONTHS), k=rng.randint(2, 6),
                                          a=a, b=b, d=rng.randint(2, 7), dish=rng.choice(DISHES),
                                          repair=rng.choice(REPAIRS), tool=rng.choice(TOOLS), goal=rng.choice(GOALS))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def readme(rows: list[tuple[str, str, str]], seed: int) -> str:
    tasks = Counter(task for task, _, _ in rows)
    examples = {}
    for task, prompt, answer in rows:
        examples.setdefault(task, (prompt, answer))
    table = "\n".join(
        f"| {task} | {n} | {examples[task][0].splitlines()[0]} | {examples[task][1]} |"
        for task, n in sorted(tasks.items())
    )
    return f"""# Sample fine-tuning dataset

A small dataset written for this project, so the demo runs offline with nothing to
download. Licence: written for tuneloop, under the project's licence; free to reuse.

`train.jsonl` holds {len(rows)} rows in OpenAI chat fine-tuning format
(`{{"messages": [system, user, assistant]}}`), all with the system prompt
"{SYSTEM_PROMPT}"
tuneloop splits its eval set off this file (data.eval_fraction).

| task | rows | example prompt | answer |
|---|---|---|---|
{table}

Why these tasks: the default base model is a tiny GPT-2 (4 layers, 128 wide) pre-trained
briefly on Python documentation. Most tasks can be learnt by such a model in a few hundred
fine-tuning steps because the answer follows from a rule or from words in the prompt;
opposites and irregular plurals have to be memorised, so expect them to score lowest on
held-out rows. Every answer is a single word or number, so exact match is a meaningful
score. The sentiment and even/odd labels are balanced; every prompt is distinct; reviews
are assembled from word lists (no real reviews, names, personal data or secrets).

Generated by `tuneloop/data/sample.py` with seed {seed}:

    python -m tuneloop.data.sample --out data/sample

regenerates `train.jsonl` and this README byte for byte (a test checks it).
"""


def write_sample(out: Path | str, seed: int = SEED) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = generate(seed)
    train = out / "train.jsonl"
    # newline="\n": the same bytes on every platform.
    with train.open("w", encoding="utf-8", newline="\n") as f:
        for _, prompt, answer in rows:
            f.write(json.dumps(_chat(prompt, answer), ensure_ascii=False) + "\n")
    doc = out / "README.md"
    doc.write_text(readme(rows, seed), encoding="utf-8", newline="\n")
    return [train, doc]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/sample"), help="folder to write into")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    for path in write_sample(args.out, args.seed):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
