"""Write examples/data/math_word_problems.jsonl: GSM8K-style word problems for math RL.

    python examples/math_word_problems.py            # -> examples/data/math_word_problems.jsonl

Each problem takes two to three arithmetic steps (shopping, discounts, speed and
distance, travel time, sharing, percentages, wages, recipes) and has an integer,
decimal, fractional or percentage answer. Every line is one record::

    {"messages": [{"role": "user", "content": Q}], "answer": "7/4",
     "solution": "3 + 4 = 7. 7 / 4 = 7/4. The answer is \\boxed{7/4}.", "template": "sharing"}

``messages`` holds the question as a chat (the jsonl dataset takes a record's prompt or
its messages, not both; ``system_prompt`` prepends a system turn); ``solution`` is the worked steps, each ``expression = value`` with exact arithmetic,
ending in the boxed answer. Use it with the jsonl dataset and ``reward = "math"``
(or ``"math_format"``): docs/datasets.md. The output is a pure function of ``--seed``
and ``--n``; plugins/datasets/tests/test_rewards.py regenerates it and compares.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Callable

DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "data" / "math_word_problems.jsonl"
DEFAULT_N = 200
DEFAULT_SEED = 13
INSTRUCTION = "Reason step by step, then give the final answer as \\boxed{answer}."

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo",
         "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yara", "Zoe")
ITEMS = (("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("sandwich", "sandwiches"),
         ("candle", "candles"), ("mug", "mugs"), ("ticket", "tickets"), ("comic book", "comic books"),
         ("bag of rice", "bags of rice"), ("cupcake", "cupcakes"))
CLOTHES = ("shirt", "jacket", "pair of shoes", "backpack", "lamp", "board game", "helmet")
VEHICLES = (("drives", "car"), ("rides", "bike"), ("rides", "scooter"), ("sails", "boat"))
SHARED = (("meters of ribbon", "meters"), ("liters of juice", "liters"), ("kilograms of flour", "kilograms"),
          ("pizzas", "pizzas"), ("meters of rope", "meters"))
COUNTED = (("marbles", "bags"), ("stickers", "albums"), ("seeds", "pots"), ("beads", "bracelets"))
CLUBS = ("the chess club", "the choir", "the robotics team", "the swim team", "the drama club")
JOBS = ("at a bakery", "at the library", "as a tutor", "at a bike shop", "at a cafe")
BAKES = (("cups of sugar", "muffins"), ("cups of flour", "pancakes"), ("teaspoons of salt", "rolls"),
         ("cups of milk", "waffles"))


def number(x: Fraction) -> str:
    """``x`` as the steps write it: ``12``, ``2.25``, or ``7/3`` when the decimal never ends."""
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d != 1:
        return f"{x.numerator}/{x.denominator}"
    with localcontext() as ctx:
        ctx.prec = 50
        return format(Decimal(x.numerator) / Decimal(x.denominator), "f")


def money(x: Fraction) -> str:
    """``x`` dollars in a question: ``$3.50``, ``$12``."""
    return f"${x.numerator}" if x.denominator == 1 else f"${float(x):.2f}"


class Steps:
    """The worked solution: each step an expression, its exact value, written ``expr = value``."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, expr: str, value: Fraction) -> Fraction:
        self.lines.append(f"{expr} = {number(value)}.")
        return value


def n(x: Fraction) -> str:
    """A number inside a step's expression; fractions in parentheses."""
    s = number(x)
    return f"({s})" if "/" in s else s


Problem = tuple[str, Steps, Fraction, str]  # question, steps, answer, answer style


def shopping_total(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    (one_a, many_a), (one_b, many_b) = rng.sample(ITEMS, 2)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    pa, pb = Fraction(rng.randint(3, 40), 4), Fraction(rng.randint(2, 30), 2)
    s = Steps()
    ca = s(f"{a} * {n(pa)}", a * pa)
    cb = s(f"{b} * {n(pb)}", b * pb)
    total = s(f"{n(ca)} + {n(cb)}", ca + cb)
    q = (f"{who} buys {a} {many_a} at {money(pa)} each and {b} {many_b} at {money(pb)} each. "
         f"How many dollars does {who} spend in all?")
    return q, s, total, "money"


def shopping_change(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    one, many = rng.choice(ITEMS)
    k = rng.randint(2, 8)
    price = Fraction(rng.randint(4, 48), 4)
    bill = next(b for b in (10, 20, 50, 100) if b > k * price)
    s = Steps()
    cost = s(f"{k} * {n(price)}", k * price)
    change = s(f"{bill} - {n(cost)}", bill - cost)
    q = (f"A {one} costs {money(price)}. {who} buys {k} {many} and pays with a ${bill} bill. "
         f"How many dollars of change does {who} get back?")
    return q, s, change, "money"


def discount(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    thing = rng.choice(CLOTHES)
    price = Fraction(rng.randint(4, 24) * 5)
    pct = rng.choice((10, 15, 20, 25, 30, 40, 50))
    k = rng.randint(2, 4)
    s = Steps()
    off = s(f"{n(price)} * {pct} / 100", price * pct / 100)
    sale = s(f"{n(price)} - {n(off)}", price - off)
    total = s(f"{k} * {n(sale)}", k * sale)
    q = (f"A {thing} usually costs {money(price)}. This week every {thing} is {pct}% off. "
         f"{who} buys {k} of them. How many dollars does {who} pay?")
    return q, s, total, "money"


def distance(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    verb, vehicle = rng.choice(VEHICLES)
    v1, v2 = rng.randint(8, 60), rng.randint(8, 60)
    t1, t2 = Fraction(rng.randint(1, 8), 2), Fraction(rng.randint(1, 6), 2)
    s = Steps()
    d1 = s(f"{v1} * {n(t1)}", v1 * t1)
    d2 = s(f"{v2} * {n(t2)}", v2 * t2)
    total = s(f"{n(d1)} + {n(d2)}", d1 + d2)
    q = (f"{who} {verb} a {vehicle} at {v1} km per hour for {number(t1)} hours, then at {v2} km per hour "
         f"for {number(t2)} hours. How many kilometers does {who} travel in total?")
    return q, s, total, "number"


def travel_time(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    d = rng.randint(6, 60)
    v_out, v_back = rng.sample(range(4, 31), 2)
    s = Steps()
    out = s(f"{d} / {v_out}", Fraction(d, v_out))
    back = s(f"{d} / {v_back}", Fraction(d, v_back))
    total = s(f"{n(out)} + {n(back)}", out + back)
    q = (f"{who} walks and jogs to a lake {d} km away at {v_out} km per hour and comes back the same way "
         f"at {v_back} km per hour. How many hours does the round trip take?")
    return q, s, total, "fraction"


def sharing(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    stuff, unit = rng.choice(SHARED)
    have = rng.randint(6, 40)
    used = rng.randint(1, have - 2)
    k = rng.randint(3, 9)
    s = Steps()
    left = s(f"{have} - {used}", Fraction(have - used))
    each = s(f"{n(left)} / {k}", left / k)
    q = (f"{who} has {have} {stuff}. {who} uses {used} {unit} and shares the rest equally among {k} friends. "
         f"How many {unit} does each friend get?")
    return q, s, each, "fraction"


def packing(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    things, boxes = rng.choice(COUNTED)
    per, k, extra = rng.randint(4, 15), rng.randint(3, 12), rng.randint(5, 40)
    s = Steps()
    packed = s(f"{per} * {k}", Fraction(per * k))
    total = s(f"{n(packed)} + {extra}", packed + extra)
    q = (f"{who} fills {k} {boxes} with {per} {things} each and has {extra} {things} left over. "
         f"How many {things} did {who} start with?")
    return q, s, total, "number"


def club_share(rng: random.Random) -> Problem:
    pct = rng.choice((10, 20, 25, 40, 50, 60, 75))
    part = rng.choice((2, 3, 4, 5))
    unit = 100 // math.gcd(100, pct)
    students = unit * part * rng.randint(1, 6)
    while students < 60:
        students += unit * part
    club = rng.choice(CLUBS)
    s = Steps()
    joined = s(f"{students} * {pct} / 100", Fraction(students * pct, 100))
    first_year = s(f"{n(joined)} / {part}", joined / part)
    q = (f"A school has {students} students and {pct}% of them are in {club}. "
         f"One out of every {part} members of {club} is in the first year. "
         f"How many first-year students are in {club}?")
    return q, s, first_year, "number"


def score_percent(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    while True:
        b, d = rng.choice((20, 25, 40, 50)), rng.choice((10, 20, 30, 50, 60))
        a, c = rng.randint(b // 2, b), rng.randint(d // 2, d)
        pct = Fraction(a + c, b + d) * 100
        if (pct * 10).denominator == 1:  # at most one decimal place: 87.5%
            break
    s = Steps()
    got = s(f"{a} + {c}", Fraction(a + c))
    out_of = s(f"{b} + {d}", Fraction(b + d))
    share = s(f"{n(got)} / {n(out_of)} * 100", got / out_of * 100)
    q = (f"{who} scores {a} out of {b} points on the first quiz and {c} out of {d} points on the second. "
         f"What percent of all the points did {who} score?")
    return q, s, share, "percent"


def wages(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    job = rng.choice(JOBS)
    rate = Fraction(rng.randint(16, 40), 2)
    hours, days = rng.randint(2, 8), rng.randint(3, 6)
    spent = rng.randint(10, 60)
    s = Steps()
    daily = s(f"{n(rate)} * {hours}", rate * hours)
    earned = s(f"{n(daily)} * {days}", daily * days)
    saved = s(f"{n(earned)} - {spent}", earned - spent)
    q = (f"{who} works {job} for {money(rate)} an hour, {hours} hours a day, for {days} days. "
         f"{who} spends ${spent} of it on a gift. How many dollars does {who} have left?")
    return q, s, saved, "money"


def recipe(rng: random.Random) -> Problem:
    who = rng.choice(NAMES)
    stuff, baked = rng.choice(BAKES)
    amount = Fraction(rng.randint(1, 7), rng.choice((2, 3, 4)))
    batch = rng.choice((6, 8, 12, 16))
    want = rng.choice([m for m in (4, 9, 10, 18, 20, 24, 30, 36) if m != batch])
    s = Steps()
    per = s(f"{n(amount)} / {batch}", amount / batch)
    need = s(f"{n(per)} * {want}", per * want)
    q = (f"A recipe uses {number(amount)} {stuff} to make {batch} {baked}. "
         f"How many {stuff} does {who} need to make {want} {baked}?")
    return q, s, need, "fraction"


TEMPLATES: tuple[tuple[str, Callable[[random.Random], Problem]], ...] = (
    ("shopping", shopping_total), ("change", shopping_change), ("discount", discount), ("distance", distance),
    ("travel_time", travel_time), ("sharing", sharing), ("packing", packing), ("club_share", club_share),
    ("score_percent", score_percent), ("wages", wages), ("recipe", recipe),
)


def answer_text(x: Fraction, style: str, rng: random.Random) -> str:
    """The record's answer, in one of the forms a reference answer takes in the wild."""
    if style == "percent":
        return number(x) + "%"
    if x.denominator == 1:
        return str(x.numerator)
    plain = number(x)
    if style == "money":
        return f"{float(x):.2f}" if "/" not in plain else plain
    forms = [f"{x.numerator}/{x.denominator}", f"\\frac{{{x.numerator}}}{{{x.denominator}}}"]
    if "/" not in plain:
        forms.append(plain)
    return rng.choice(forms)


def generate(n: int = DEFAULT_N, seed: int = DEFAULT_SEED) -> list[dict]:
    """``n`` distinct problems, the templates taken in turn; a pure function of ``seed``."""
    rng = random.Random(f"math_word_problems/{seed}")
    records: list[dict] = []
    seen: set[str] = set()
    while len(records) < n:
        name, template = TEMPLATES[len(records) % len(TEMPLATES)]
        question, steps, value, style = template(rng)
        if question in seen:
            continue
        seen.add(question)
        answer = answer_text(value, style, rng)
        content = f"{question} {INSTRUCTION}"
        solution = " ".join(steps.lines) + f" The answer is \\boxed{{{answer}}}."
        records.append({
            "messages": [{"role": "user", "content": content}],
            "answer": answer,
            "solution": solution,
            "template": name,
        })
    return records


def render(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"the JSON-lines file (default {DEFAULT_OUT})")
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="how many problems")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(generate(args.n, args.seed)), encoding="utf-8")
    print(f"wrote {args.n} problems to {out}")


if __name__ == "__main__":
    main()
