"""Generate the ticket-routing dataset (data/tickets/), written for this project.

    python -m tuneloop.data.tickets --out data/tickets

rebuilds data/tickets/train.jsonl and data/tickets/README.md byte for byte: every choice
comes from one seeded random generator, rows are written in a fixed order and keys in a
fixed order, and nothing iterates over a set (whose order changes from run to run).

The task is the templated classification that a real-model config (configs/smollm2.yaml)
can learn and measure: route a customer-support ticket to one of six teams. Choices:

- Tickets are assembled from phrase banks per class (a problem sentence, optionally a
  context sentence, a detail, a request and a closing, optionally after a greeting: 1 to
  4 sentences) filled with products from two lists, order numbers (#48213), amounts and
  days. The vocabulary overlaps on purpose: every class mentions orders, products, "my
  account", money, refunds or deliveries somewhere, so the class lies in what the customer
  wants, not in one giveaway word.
- Classes are unbalanced like a real queue (deliveries most, product questions least; the
  largest holds under 30 %) but every class is common enough to learn.
- Each ticket appears under six prompt templates, and the answer is spelt differently
  under each ("Billing", "billing", "A", "payment", "Billing question", "payments"), as in
  T0: a model has to learn each template's label set, not one list of words.
- Tickets are distinct and no two are near-duplicates: a candidate whose 3-word shingles
  overlap an earlier ticket's by NEAR_DUPLICATE or more (containment, as in
  tuneloop/data/neardup.py) is drawn again. The ticket is most of every prompt, so the
  split (data.split_group_threshold) groups a ticket's six rows and puts them on one side:
  an eval score measures tickets the model never saw, under templates it did. The split
  compares prompts less their boilerplate (shingles in more than 50 prompts: the templates,
  stock phrases), which can leave a short ticket too little content to tie its templates
  together, or two tickets sharing a long stock sentence too alike; such tickets are drawn
  again (_weak), and generate() asserts that neardup groups the rows ticket by ticket.
- Completions follow OpenAI's legacy format: a leading space, the answer (1 to 3 words)
  and the <|endoftext|> end marker; each row also carries `template` (the template id)
  and `label` (the canonical class), which the loader keeps in `extra`.
- No names, no e-mail addresses, no phone numbers, no secrets: the data gate drops rows
  with personal data, and there is none to drop.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

from tuneloop.data.neardup import (DEFAULT_THRESHOLD, containment, content_shingles, near_duplicate_groups,
                                     word_shingles)

SEED = 20240917
END_MARKER = "<|endoftext|>"
# A candidate ticket sharing this share of its 3-word shingles with an earlier one is a
# near-duplicate (the split groups prompts at 0.75 after dropping template boilerplate).
NEAR_DUPLICATE = 0.5
# Margins around the split's DEFAULT_THRESHOLD (0.75), in content containment (see _weak):
# a ticket's templates must overlap at least WITHIN_TICKET, two tickets under one template
# less than ACROSS_TICKETS. Tickets that miss are drawn again, for up to REDRAW_ROUNDS rounds.
WITHIN_TICKET = 0.8
ACROSS_TICKETS = 0.5
REDRAW_ROUNDS = 20

# Tickets per class: a queue where deliveries come first and product questions last.
CLASSES = {"shipping": 84, "billing": 68, "technical": 60, "returns": 54, "account": 52, "product": 50}

DEVICES = ["smart thermostat", "robot vacuum", "espresso machine", "fitness tracker", "e-reader",
           "bluetooth speaker", "air purifier", "electric toothbrush", "baby monitor", "video doorbell",
           "portable projector", "electric kettle", "game controller", "webcam", "label printer",
           "wireless headset", "smartwatch", "coffee grinder"]
GOODS = ["hiking backpack", "winter jacket", "yoga mat", "cast iron pan", "office chair", "duvet cover",
         "ceramic teapot", "rain jacket", "wool blanket", "garden hose", "travel suitcase", "knife block",
         "picture frame", "water bottle", "bike helmet", "bath towel"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
# When an order was placed: its weekday is drawn apart from the ticket's {weekday}.
WHEN = ["last week", "on {weekday}", "earlier this month", "a fortnight ago", "last month"]

GREETINGS = ["Hi,", "Hello,", "Hi there,", "Good morning,", "Hey,", "Dear support team,", "Good afternoon,"]
CLOSINGS = ["Thanks.", "Thank you.", "Thanks in advance.", "Many thanks.", "Kind regards.", "Best wishes.",
            "Cheers.", "Thanks for your help."]
# Context any class can open with.
SHARED_CONTEXTS = ["I have been a customer for {years} years.", "I have ordered from you several times before.",
                   "I use this account for the whole household."]

# Per class: problems (the sentence every ticket has, with the product pool it fits:
# "device", "good" or "any"), contexts, details and requests. {product} is the product,
# {a_product} the same with its article, {other} another product of the same pool.
BANKS: dict[str, dict[str, list]] = {
    "billing": {
        "problems": [
            ("I was charged twice for order {order}.", "any"),
            ("My card was charged {amount} but the receipt for order {order} says {amount2}.", "any"),
            ("The payment for the {product} failed, yet the money has left my bank account.", "any"),
            ("I need an invoice with my company's tax details for order {order}.", "any"),
            ("My monthly subscription fee went up to {amount} without any notice.", "any"),
            ("The discount code was accepted at checkout, but the discount is missing from my bill for "
             "order {order}.", "any"),
            ("There is a charge of {amount} on my statement that I do not recognise.", "any"),
            ("I paid for order {order} by bank transfer {days} days ago and it still shows as unpaid.", "any"),
            ("I was billed for express delivery on order {order} although I chose the free option.", "any"),
            ("My account shows an outstanding balance of {amount} that I have already paid.", "any"),
            ("You charged me {amount} for the {product}, but it was listed at {amount2} when I paid.", "any"),
            ("I cancelled my membership last month and was still charged {amount} this month.", "any"),
            ("My card was declined three times when I tried to pay for the {product}, although there is "
             "plenty of money on it.", "any"),
            ("The invoice for the {product} shows the wrong billing address.", "any"),
            ("I was charged {amount} in fees for paying in instalments, which nobody mentioned.", "any"),
        ],
        "contexts": ["I ordered {a_product} {when}.", "This is about order {order}.", "My order number is {order}.",
                     "I pay for your premium membership every month.", "I bought {a_product} for my office."],
        "details": ["I checked my online banking this morning.",
                    "I need this sorted before the end of the month.",
                    "It looks like a mistake in your billing system.",
                    "I still have the receipt from checkout if you need it.",
                    "This is only about the money; everything else was fine.",
                    "The {product} is great, the bill is the problem."],
        "requests": ["Please correct my bill.", "Could you send me a corrected invoice?",
                     "Please explain what this amount is for.", "Please put this right on my bill.",
                     "I would like the difference put back on my card.", "Could you look into this, please?"],
    },
    "shipping": {
        "problems": [
            ("Order {order} was supposed to arrive on {weekday}, but it has not come yet.", "any"),
            ("The tracking page for order {order} has not changed for {days} days.", "any"),
            ("The courier marked order {order} as delivered, but nothing was left at my door.", "any"),
            ("I paid {amount} for express delivery and the {product} is still on its way after {days} days.", "any"),
            ("I entered the wrong delivery address for order {order}; can it still be changed before it ships?", "any"),
            ("Only part of order {order} arrived; the {product} was not in the box.", "any"),
            ("My {product} has been stuck at the local depot since {weekday}.", "any"),
            ("The driver left a note saying they would come back for order {order}, but nobody came.", "any"),
            ("Do you deliver to the islands, and how long would the {product} take to get there?", "any"),
            ("The confirmation said order {order} would be dispatched within two days, and it is now "
             "{days} days later.", "any"),
            ("The parcel with my {product} went back to your warehouse because the courier could not find "
             "my building.", "any"),
            ("My account says order {order} has shipped, but the courier has no record of it.", "any"),
            ("I need the {product} before {weekday}; is there any way to speed up the delivery?", "any"),
            ("The parcel for order {order} was left with a neighbour I do not know, and I cannot find it.", "any"),
            ("Order {order} has been waiting at customs for {days} days.", "any"),
        ],
        "contexts": ["I ordered {a_product} {when}.", "This is about order {order}.", "My order number is {order}.",
                     "I bought {a_product} as a birthday present.", "I chose home delivery for {a_product}."],
        "details": ["I was at home all day and nobody rang the bell.",
                    "The tracking number does not work on the courier's website.",
                    "My neighbours have not seen the parcel either.",
                    "It is a present, so the date matters.",
                    "The estimated delivery date keeps moving back.",
                    "The payment went through fine, it is only the delivery I am worried about.",
                    "My account still shows the order as in transit."],
        "requests": ["Could you find out where the parcel is?", "Please tell me when it will arrive.",
                     "Can you send another one if it is lost?", "Please ask the courier to try again.",
                     "Could you look into this, please?"],
    },
    "technical": {
        "problems": [
            ("My {product} will not turn on anymore, even after a full night on the charger.", "device"),
            ("The {product} keeps restarting every few minutes.", "device"),
            ("The {product} has not connected to my home wifi since the last update.", "device"),
            ("The app crashes every time I try to pair it with my {product}.", "device"),
            ("The firmware update for the {product} stopped halfway and now the screen stays blank.", "device"),
            ("The {product} makes a loud clicking noise and then switches itself off.", "device"),
            ("The app for the {product} shows an error page whenever I open my account in it.", "device"),
            ("The battery of the {product} runs flat within an hour, although it used to last all day.", "device"),
            ("The {product} from order {order} shows an error code on the display and will not start.", "device"),
            ("Bluetooth pairing with the {product} fails with every phone I have tried.", "device"),
            ("The app for the {product} freezes when I press the pay button for a spare part, so I cannot "
             "finish my order.", "device"),
            ("The buttons on the {product} stopped responding after {days} days of use.", "device"),
            ("The {product} forgets all its settings every time it is unplugged.", "device"),
            ("The {product} gets very hot after a few minutes and then cuts out.", "device"),
            ("The sound from the {product} keeps dropping out for a few seconds at a time.", "device"),
        ],
        "contexts": ["I bought {a_product} with order {order}.", "I have had my {product} for {days} months.",
                     "We use the {product} every day."],
        "details": ["I have already tried resetting it to factory settings.",
                    "I tried a different cable and a different socket, with the same result.",
                    "The app and the {product} both run the latest version.",
                    "It worked fine for the first {days} days.",
                    "I followed every step in the manual.",
                    "I would rather not send it back if there is a fix.",
                    "The same happens on my phone and on my laptop."],
        "requests": ["Is there a fix for this?", "Could you walk me through the troubleshooting steps?",
                     "Is this a known problem with this model?", "What should I try next?",
                     "Could you look into this, please?"],
    },
    "account": {
        "problems": [
            ("I cannot log into my account to check order {order}, because the password reset link never arrives.", "any"),
            ("My account was locked after too many login attempts, and I still cannot get in.", "any"),
            ("I would like to delete my account and all the data you hold about me.", "any"),
            ("The code for two-step login is not being sent to my phone.", "any"),
            ("I changed my password on {weekday} and now the app says my login details are wrong.", "any"),
            ("Someone else seems to have signed into my account and changed my delivery address.", "any"),
            ("I have two accounts by mistake and would like my order history merged into one.", "any"),
            ("I would like to change the name on my account, and I cannot find where to do it.", "any"),
            ("Please stop the marketing messages but keep my account open.", "any"),
            ("I cannot get into my account, and there is a gift card balance of {amount} on it that I want to use.", "any"),
            ("The sign-in page has sent me back to the start every time I entered my password since {weekday}.", "any"),
            ("I placed order {order} as a guest and would like it added to my account.", "any"),
            ("My account was suspended the day after I ordered {a_product}, and I do not know why.", "any"),
            ("I no longer have the phone that receives my login codes.", "any"),
        ],
        "contexts": ["I bought {a_product} {when}.", "I last ordered from you {when}.",
                     "My last order was {order}.", "I set up my account years ago."],
        "details": ["I can answer the security questions if that helps.",
                    "I have already cleared the browser cache and tried another device.",
                    "I would rather not open a new account, because all my past orders are in this one.",
                    "The last time I signed in without trouble was on {weekday}.",
                    "I am worried someone else knows my password.",
                    "This has never happened to me before."],
        "requests": ["Could you reset my login for me?", "Please confirm once it is done.",
                     "Please tell me how to get back into my account.", "What do you need from me to prove it is mine?",
                     "Could you look into this, please?"],
    },
    "returns": {
        "problems": [
            ("I would like to return the {product} from order {order}; it is not what I expected.", "any"),
            ("The {product} arrived with a cracked corner and I want to send it back for a refund.", "any"),
            ("I sent the {product} back {days} days ago and have not received my refund of {amount} yet.", "any"),
            ("The {product} is the wrong colour; can I exchange it for the grey one?", "any"),
            ("The return label in my account for the {product} is rejected at the post office.", "any"),
            ("I received the wrong item in order {order}: I ordered {a_product} and got {a_other} instead.", "any"),
            ("How many days do I have to return the {product} if it is still unopened?", "any"),
            ("I changed my mind about the {product} and would like my money back.", "any"),
            ("The {product} stopped working after a week, and I would rather have a refund than a repair.", "device"),
            ("I want to send back two of the three items in order {order}.", "any"),
            ("The courier collected my return on {weekday}, but the status still says you have not received it.", "any"),
            ("The {product} is much smaller than the photos suggest, so I would like to return it.", "good"),
            ("I was sent the {product} twice by mistake and need to return one of them.", "any"),
            ("The {product} has a tear in the fabric, and I would like to exchange it for a new one.", "good"),
        ],
        "contexts": ["I ordered {a_product} {when}.", "This is about order {order}.", "My order number is {order}.",
                     "I bought {a_product} as a gift.", "I received my order {when}."],
        "details": ["It is still in the original box with all the tags.", "I have kept all the packaging.",
                    "It has never been used.", "I paid {amount} for it.", "The rest of the order was fine.",
                    "I printed the return slip from my account."],
        "requests": ["Please send me a return label.", "Could you tell me how to send it back?",
                     "I would prefer a refund to store credit.", "Please exchange it rather than refund it.",
                     "Could you look into this, please?"],
    },
    "product": {
        "problems": [
            ("Does the {product} work with both iPhone and Android phones?", "device"),
            ("Is the {product} available in a larger size or a different colour?", "good"),
            ("When will the {product} be back in stock?", "any"),
            ("What is the difference between the {product} and the newer model you launched this spring?", "device"),
            ("How long is the warranty on the {product}, and does it cover accidental damage?", "any"),
            ("Can the {product} run on batteries, or does it need to stay plugged in?", "device"),
            ("Is the {product} still {amount}, or was that a limited offer?", "any"),
            ("If I buy a second {product}, can both be controlled from the same app?", "device"),
            ("Does the {product} come with a carrying case, or do I need to order one separately?", "any"),
            ("What are the exact measurements of the {product} when it is folded?", "good"),
            ("Is the {product} safe to leave running overnight?", "device"),
            ("How should I clean the {product} so that it lasts?", "good"),
            ("Is the {product} suitable for use outdoors in the rain?", "any"),
            ("What is the {product} made of?", "good"),
        ],
        "contexts": ["I am thinking of buying {a_product}.", "I saw {a_product} on your website.",
                     "I bought {a_product} from you last year with order {order}.",
                     "I want to order {a_product} for my parents."],
        "details": ["I want to buy one as a gift.", "The product page does not say.",
                    "I could not find this in the description.", "I would order today if the answer is yes.",
                    "My current one is from another brand.", "I have it saved in my account's wish list."],
        "requests": ["Thanks for any advice before I place the order.", "Could you send me the specifications?",
                     "Please let me know before the weekend."],
    },
}

# Template id -> (prompt with {ticket}, the answer per class). The ticket is most of each
# prompt; the answers differ by template, as in T0.
TEMPLATES: dict[str, tuple[str, dict[str, str]]] = {
    "route_team": (
        "Route this support ticket to a team.\nTicket: {ticket}\nTeam:",
        {"billing": "Billing", "shipping": "Shipping", "technical": "Tech Support",
         "account": "Customer Accounts", "returns": "Returns Desk", "product": "Sales"},
    ),
    "department": (
        "Which department should handle the following message?\n\n{ticket}\n\nAnswer:",
        {"billing": "billing", "shipping": "shipping", "technical": "technical",
         "account": "account", "returns": "returns", "product": "product"},
    ),
    "lettered": (
        "{ticket}\n\nWhich queue should this ticket go to?\nA. Payments\nB. Deliveries\nC. Technical issues\n"
        "D. Login and account\nE. Returns and refunds\nF. Product questions\nAnswer with a letter:",
        {"billing": "A", "shipping": "B", "technical": "C", "account": "D", "returns": "E", "product": "F"},
    ),
    "one_word": (
        "Customer message: {ticket}\nWhat is this message about? Reply with one word:",
        {"billing": "payment", "shipping": "delivery", "technical": "malfunction",
         "account": "login", "returns": "refund", "product": "product"},
    ),
    "question_first": (
        "Is the message below a billing question, a delivery problem, a technical fault, an account issue, "
        "a return request or a product question?\n\n{ticket}\n",
        {"billing": "Billing question", "shipping": "Delivery problem", "technical": "Technical fault",
         "account": "Account issue", "returns": "Return request", "product": "Product question"},
    ),
    "inbox": (
        "New message in the support inbox:\n\"{ticket}\"\nWho should pick it up: payments, logistics, IT, "
        "accounts, returns or sales?",
        {"billing": "payments", "shipping": "logistics", "technical": "IT",
         "account": "accounts", "returns": "returns", "product": "sales"},
    ),
}

# How many sentences a ticket has (the problem plus optional parts), and how often.
SENTENCES = [1, 2, 3, 4]
SENTENCE_WEIGHTS = [15, 35, 32, 18]
GREETING_SHARE = 0.55


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _first_lower(sentence: str) -> str:
    """The sentence as it reads after a greeting ("Hi, the app ..."); "I" stays capital."""
    if sentence.startswith(("I ", "I'")):
        return sentence
    return sentence[0].lower() + sentence[1:]


def _amount(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


def _ticket(rng: random.Random, label: str, order: str) -> str:
    bank = BANKS[label]
    problem, pool = rng.choice(bank["problems"])
    products = DEVICES if pool == "device" else GOODS if pool == "good" else DEVICES + GOODS
    product, other = rng.sample(products, 2)
    # Two prices, the second 5 to 45 % below the first ("charged {amount} ... listed at {amount2}").
    cents = rng.randint(600, 24000)
    amount, amount2 = _amount(cents), _amount(cents * rng.randint(55, 95) // 100)
    slots = {"product": product, "a_product": _article(product), "a_other": _article(other), "order": order,
             "amount": amount, "amount2": amount2, "days": rng.randint(2, 9), "years": rng.randint(2, 12),
             "weekday": rng.choice(WEEKDAYS)}
    slots["when"] = rng.choice(WHEN).format(weekday=rng.choice([d for d in WEEKDAYS if d != slots["weekday"]]))
    contexts = bank["contexts"] + (SHARED_CONTEXTS if label != "product" else SHARED_CONTEXTS[:1])
    optional = {"context": contexts, "detail": bank["details"], "request": bank["requests"], "closing": CLOSINGS}
    n = rng.choices(SENTENCES, SENTENCE_WEIGHTS)[0]
    chosen = rng.sample(sorted(optional), n - 1)
    parts = []
    for part in ("context", "problem", "detail", "request", "closing"):
        if part == "problem":
            parts.append(problem.format(**slots))
        elif part in chosen:
            parts.append(rng.choice(optional[part]).format(**slots))
    if rng.random() < GREETING_SHARE:
        parts[0] = f"{rng.choice(GREETINGS)} {_first_lower(parts[0])}"
    return " ".join(parts)


def _draw(rng: random.Random, label: str, order: str, others: list[frozenset[str]]) -> tuple[str, frozenset[str]]:
    """A ticket whose 3-word shingles overlap none of `others` by NEAR_DUPLICATE or more."""
    for _ in range(1000):
        text = _ticket(rng, label, order)
        shingles = word_shingles(text)
        if all(containment(shingles, other) < NEAR_DUPLICATE for other in others):
            return text, shingles
    raise RuntimeError(f"no new {label} ticket after 1000 draws: the phrase banks are too small")


def _prompts(drawn: list[tuple[str, str]]) -> list[str]:
    return [prompt.format(ticket=text) for _, text in drawn for prompt, _ in TEMPLATES.values()]


def _weak(drawn: list[tuple[str, str]]) -> list[int]:
    """Tickets the split might not keep together or apart: ones with two templates under
    WITHIN_TICKET content containment, and the later of two tickets at ACROSS_TICKETS or
    more under the first template. Content is what the split compares (neardup.content_shingles:
    shingles of the whole prompt less those in more than BOILERPLATE_DF prompts)."""
    k = len(TEMPLATES)
    sets = content_shingles(_prompts(drawn))
    weak = set()
    for i in range(len(drawn)):
        own = sets[i * k:(i + 1) * k]
        if min(containment(a, b) for n, a in enumerate(own) for b in own[n + 1:]) < WITHIN_TICKET:
            weak.add(i)
    first = sets[::k]  # every ticket under the first template
    holders: dict[str, list[int]] = {}
    for i, shingles in enumerate(first):
        for shingle in sorted(shingles):
            holders.setdefault(shingle, []).append(i)
    for j, shingles in enumerate(first):
        earlier = sorted({i for shingle in shingles for i in holders[shingle] if i < j})
        if any(containment(first[i], shingles) >= ACROSS_TICKETS for i in earlier):
            weak.add(j)
    return sorted(weak)


def tickets(rng: random.Random) -> list[tuple[str, str]]:
    """The distinct tickets as (label, text), classes interleaved in a seeded order.

    Each is drawn from the phrase banks, then tickets the grouped split would mishandle
    (see _weak: a ticket too short for its templates to link, or too close to another) are
    drawn again until there are none."""
    labels = [label for label, n in CLASSES.items() for _ in range(n)]
    rng.shuffle(labels)
    orders = [f"#{n}" for n in rng.sample(range(10000, 100000), len(labels))]
    drawn: list[tuple[str, str]] = []
    kept: list[frozenset[str]] = []
    for label, order in zip(labels, orders):
        text, shingles = _draw(rng, label, order, kept)
        drawn.append((label, text))
        kept.append(shingles)
    for _ in range(REDRAW_ROUNDS):
        weak = _weak(drawn)
        if not weak:
            return drawn
        for i in weak:
            text, kept[i] = _draw(rng, labels[i], orders[i], kept[:i] + kept[i + 1:])
            drawn[i] = (labels[i], text)
    raise RuntimeError(f"tickets still too short or too alike after {REDRAW_ROUNDS} rounds of redrawing")


def generate(seed: int = SEED) -> list[dict]:
    """All rows as written: every ticket under every template, in a seeded order."""
    rng = random.Random(seed)
    drawn = tickets(rng)
    rows = []
    for label, text in drawn:
        for template, (prompt, answers) in TEMPLATES.items():
            rows.append({"prompt": prompt.format(ticket=text), "completion": f" {answers[label]}{END_MARKER}",
                         "template": template, "label": label})
    prompts = Counter(row["prompt"] for row in rows)
    duplicates = [p for p, n in prompts.items() if n > 1]
    assert not duplicates, f"duplicate prompts: {duplicates[:3]}"
    # What the split will do (data.split_group_threshold at its default): one group per ticket.
    groups = near_duplicate_groups([row["prompt"] for row in rows], DEFAULT_THRESHOLD)
    k = len(TEMPLATES)
    assert groups == [i // k for i in range(len(rows))], "the split would not group the rows ticket by ticket"
    rng.shuffle(rows)
    return rows


def _answer(row: dict) -> str:
    return row["completion"][: -len(END_MARKER)].strip()


def readme(rows: list[dict], seed: int) -> str:
    n_tickets = len(rows) // len(TEMPLATES)
    per_class = Counter(row["label"] for row in rows)
    class_table = "\n".join(
        f"| {label} | {per_class[label] // len(TEMPLATES)} | {per_class[label]} | {per_class[label] / len(rows):.1%} | "
        + " / ".join(TEMPLATES[t][1][label] for t in TEMPLATES) + " |"
        for label in CLASSES
    )
    per_template = Counter(row["template"] for row in rows)
    examples = []
    for template in TEMPLATES:
        row = next(r for r in rows if r["template"] == template)
        shown = "\n".join("    " + line if line else "" for line in row["prompt"].rstrip("\n").split("\n"))
        ends = " (the prompt ends with a line break)" if row["prompt"].endswith("\n") else ""
        examples.append(f"`{template}` ({per_template[template]} rows), class {row['label']}:\n\n{shown}\n\n"
                        f"completion{ends}: `{json.dumps(row['completion'], ensure_ascii=False)[1:-1]}`")
    answers = Counter(_answer(row) for row in rows)
    rarest, rarest_n = min(answers.items(), key=lambda kv: (kv[1], kv[0]))
    largest = max(per_class.values()) / len(rows)
    sentences = "\n\n".join(examples)
    return f"""# Ticket-routing dataset

A templated classification task written for this project: route a customer-support ticket
to the team that should handle it. It ships with the repository, so a real-model
fine-tune (configs/smollm2.yaml) has a task to learn with nothing to download. Licence:
written for tuneloop, under the project's licence; free to reuse.

`train.jsonl` holds {len(rows)} rows in OpenAI's legacy fine-tuning format
(`{{"prompt": ..., "completion": " <answer>{END_MARKER}"}}`): {n_tickets} distinct tickets,
each under {len(TEMPLATES)} prompt templates. Every row also has `template` (the template id)
and `label` (the canonical class); tuneloop's loader keeps both in `extra`. tuneloop splits
its eval set off this file (data.eval_fraction).

## Classes

| class | tickets | rows | share | answer per template ({", ".join(TEMPLATES)}) |
|---|---|---|---|---|
{class_table}

Unbalanced like a real queue (the largest class holds {largest:.1%}), so always answering
the most common class scores about {largest:.0%}.

## Templates

Each template spells the answer its own way, so {len(answers)} distinct answer strings in all;
the rarest (`{rarest}`) is {rarest_n / len(rows):.1%} of the rows. A config that trains on this
file and wants the gate's label-balance check needs validation.label_max_classes
>= {len(answers)} and a validation.min_label_share below the rarest answer's share of the train
split; with the defaults (20 classes) the check is skipped as free text. One example of each:

{sentences}

## Why it is built this way

- The answer is spelt differently under each template ("Billing", "billing", "A",
  "payment", "Billing question", "payments"), as in T0's prompted datasets: a model must
  learn each template's label set: an answer from another template's set ("payment"
  where "payments" is asked) scores 0 on exact match.
- Tickets are 1 to 4 sentences assembled from phrase banks per class, with products,
  order numbers, amounts and days filled in. Every class talks about orders, products,
  "my account", money, refunds or deliveries somewhere, so the class is in what the
  customer wants, not in one giveaway word.
- No two tickets are near-duplicates (3-word shingle containment below {NEAR_DUPLICATE}), and the
  ticket is most of every prompt, so tuneloop's grouped split (data.split_group_threshold)
  keeps a ticket's {len(TEMPLATES)} rows together: every eval ticket is one the model never saw
  under any template, and an eval score measures generalisation to new tickets, under
  templates it learnt. The generator makes sure of it: it draws a ticket again when its
  prompts, less template boilerplate, overlap each other below {WITHIN_TICKET} or another ticket's at
  {ACROSS_TICKETS} or more (the split groups at {DEFAULT_THRESHOLD}), and asserts that the split's
  grouping (tuneloop/data/neardup.py) gives exactly one group per ticket.
- No names, e-mail addresses, phone numbers or secrets anywhere; order numbers are made up.

Generated by `tuneloop/data/tickets.py` with seed {seed}:

    python -m tuneloop.data.tickets --out data/tickets

regenerates `train.jsonl` and this README byte for byte (a test checks it).
"""


def write(out_dir: Path | str, seed: int = SEED) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = generate(seed)
    train = out / "train.jsonl"
    # newline="\n": the same bytes on every platform.
    with train.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    doc = out / "README.md"
    doc.write_text(readme(rows, seed), encoding="utf-8", newline="\n")
    return [train, doc]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/tickets"), help="folder to write into")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    for path in write(args.out, args.seed):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
