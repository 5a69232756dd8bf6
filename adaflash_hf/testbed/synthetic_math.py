"""A small, deterministic generator of SYNTHETIC grade-school math word problems (GSM8K-style).

No GSM8K file ships in any package reachable offline, and ``reasoning-gym``'s ``gsm_symbolic``
generator is an optional extra with many pinned dependencies. The 270 CHAMP competition problems
alone are too few to train a drafter on the math domain, so this module fills the gap with
templated multi-step arithmetic problems.

Problem ``i`` depends only on ``i`` (its own ``random.Random`` seeded with a string, which is
stable across Python runs and versions), so ids and texts never change when more are generated.
Every template keeps the numbers integral so the problems have clean answers, which are returned
alongside the question for completeness.
"""

from __future__ import annotations

import random
from typing import Callable


_NAMES = [
    ("Alice", "she"), ("Ben", "he"), ("Carmen", "she"), ("Diego", "he"), ("Emma", "she"),
    ("Farid", "he"), ("Grace", "she"), ("Hiro", "he"), ("Ines", "she"), ("Jamal", "he"),
    ("Keiko", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Olga", "she"),
    ("Pavel", "he"), ("Quinn", "she"), ("Ravi", "he"), ("Sofia", "she"), ("Tomas", "he"),
]
_ITEMS = [("notebooks", 3), ("pencils", 1), ("apples", 1), ("books", 12), ("mugs", 7), ("toy cars", 5),
          ("scarves", 15), ("candles", 4), ("plants", 9), ("puzzles", 11)]
_CROPS = [("tomato", "tomatoes"), ("pepper", "peppers"), ("bean", "beans"), ("strawberry", "strawberries")]
_CONTAINERS = ["boxes", "bags", "crates", "baskets"]

Template = Callable[[random.Random], "tuple[str, int]"]


def _person(rng: random.Random, avoid: str | None = None) -> tuple[str, str]:
    while True:
        name, pronoun = rng.choice(_NAMES)
        if name != avoid:
            return name, pronoun


def _shopping(rng):
    name, he = _person(rng)
    (item_a, price_a), (item_b, price_b) = rng.sample(_ITEMS, 2)
    count_a, count_b = rng.randint(2, 9), rng.randint(2, 9)
    budget = (count_a * price_a + count_b * price_b) + rng.randint(1, 40)
    question = (
        f"{name} buys {count_a} {item_a} at ${price_a} each and {count_b} {item_b} at ${price_b} each. "
        f"{he.capitalize()} pays with ${budget}. How much change does {he} get back?"
    )
    return question, budget - count_a * price_a - count_b * price_b


def _savings(rng):
    name, he = _person(rng)
    weekly, weeks = rng.randint(5, 40), rng.randint(4, 20)
    spent = rng.randint(1, weekly * weeks - 1)
    question = (
        f"{name} saves ${weekly} every week. After {weeks} weeks, {he} spends ${spent} on a new bike "
        f"helmet. How much money does {he} have left?"
    )
    return question, weekly * weeks - spent


def _travel(rng):
    speed_a, hours_a = rng.randint(30, 80), rng.randint(1, 6)
    speed_b, hours_b = rng.randint(20, 70), rng.randint(1, 5)
    vehicle = rng.choice(["A train", "A bus", "A truck", "A car"])
    question = (
        f"{vehicle} travels at {speed_a} miles per hour for {hours_a} hours and then at {speed_b} miles "
        f"per hour for {hours_b} hours. How many miles does it travel in total?"
    )
    return question, speed_a * hours_a + speed_b * hours_b


def _fraction_gift(rng):
    (name, he), (friend, _) = _person(rng), _person(rng)
    while friend == name:
        friend, _ = _person(rng)
    denominator = rng.choice([2, 3, 4, 5])
    word = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth"}[denominator]
    total, extra = denominator * rng.randint(4, 30), rng.randint(2, 25)
    question = (
        f"{name} has {total} marbles. {he.capitalize()} gives {word} of them to {friend} and then buys "
        f"{extra} more. How many marbles does {name} have now?"
    )
    return question, total - total // denominator + extra


def _discount(rng):
    name, he = _person(rng)
    price, percent, count = 20 * rng.randint(1, 15), rng.choice([10, 20, 25, 50]), rng.randint(2, 6)
    thing = rng.choice(["jacket", "lamp", "backpack", "pair of shoes", "board game"])
    question = (
        f"A {thing} costs ${price}. It is on sale for {percent}% off. {name} buys {count} of them at the "
        f"sale price. How much does {he} pay in total?"
    )
    return question, count * (price - price * percent // 100)


def _baking(rng):
    (name, _), (friend, _) = _person(rng), _person(rng)
    while friend == name:
        friend, _ = _person(rng)
    rate_a, rate_b, hours, box = rng.randint(6, 30), rng.randint(6, 30), rng.randint(2, 6), rng.choice([6, 8, 12])
    question = (
        f"{name} can bake {rate_a} cookies per hour and {friend} can bake {rate_b} cookies per hour. They "
        f"bake together for {hours} hours and pack the cookies in boxes of {box}. How many boxes can "
        "they fill completely?"
    )
    return question, (rate_a + rate_b) * hours // box


def _ages(rng):
    (name, _), (friend, _) = _person(rng), _person(rng)
    while friend == name:
        friend, _ = _person(rng)
    age, factor, years = rng.randint(3, 15), rng.randint(2, 4), rng.randint(2, 12)
    question = (
        f"{name} is {age} years old. {friend} is {factor} times as old as {name}. In {years} years, what "
        "will be the sum of their ages?"
    )
    return question, age + factor * age + 2 * years


def _harvest(rng):
    name, he = _person(rng)
    (crop, crops), container = rng.choice(_CROPS), rng.choice(_CONTAINERS)
    rows, per_row, per_plant = rng.randint(3, 12), rng.randint(4, 15), rng.randint(3, 10)
    size = rng.choice([5, 10, 20])
    question = (
        f"{name} plants {rows} rows of {crop} plants with {per_row} plants in each row. Each plant "
        f"produces {per_plant} {crops}. {he.capitalize()} packs the {crops} into {container} of {size}. "
        f"How many full {container} does {he} get?"
    )
    return question, rows * per_row * per_plant // size


def _reading(rng):
    name, he = _person(rng)
    monday = rng.randint(10, 40)
    pages = 3 * monday + rng.randint(20, 200)
    question = (
        f"{name} is reading a {pages}-page book. {he.capitalize()} reads {monday} pages on Monday and "
        "twice as many pages on Tuesday. How many pages are left to read?"
    )
    return question, pages - 3 * monday


def _classroom(rng):
    students, percent = 20 * rng.randint(1, 5), rng.choice([25, 40, 50, 60, 75])
    girl_pens, boy_pens = rng.randint(1, 6), rng.randint(1, 6)
    girls = students * percent // 100
    question = (
        f"There are {students} students in a class and {percent}% of them are girls. Each girl has "
        f"{girl_pens} pencils and each boy has {boy_pens} pencils. How many pencils do the students "
        "have in total?"
    )
    return question, girls * girl_pens + (students - girls) * boy_pens


def _wages(rng):
    name, he = _person(rng)
    rate, hours, overtime = rng.randint(10, 30), rng.randint(20, 40), rng.randint(1, 10)
    question = (
        f"{name} earns ${rate} per hour for the first {hours} hours of a week and 1.5 times that rate for "
        f"every hour beyond. Last week {he} worked {hours + 2 * overtime} hours. How much did {he} earn?"
    )
    return question, rate * hours + 3 * rate * overtime


def _tank(rng):
    capacity, rate_in, rate_out = 60 * rng.randint(2, 20), rng.randint(8, 20), rng.randint(1, 7)
    start = rng.randint(0, capacity // 4)
    minutes = -(-(capacity - start) // (rate_in - rate_out))
    question = (
        f"A water tank holds {capacity} liters and already contains {start} liters. Water flows in at "
        f"{rate_in} liters per minute while a leak drains {rate_out} liters per minute. After how many "
        "whole minutes is the tank full for the first time?"
    )
    return question, minutes


TEMPLATES: dict[str, Template] = {
    "shopping": _shopping, "savings": _savings, "travel": _travel, "fraction": _fraction_gift,
    "discount": _discount, "baking": _baking, "ages": _ages, "harvest": _harvest,
    "reading": _reading, "classroom": _classroom, "wages": _wages, "tank": _tank,
}


def gsm_problem(index: int) -> tuple[str, str, int]:
    """Return ``(template_name, question, answer)`` of synthetic problem number ``index``."""
    rng = random.Random(f"adaflash-synthetic-gsm-{index}")
    name = sorted(TEMPLATES)[rng.randrange(len(TEMPLATES))]
    question, answer = TEMPLATES[name](rng)
    return name, question, answer


def generate_gsm_problems(count: int) -> list[dict]:
    """Generate ``count`` synthetic problems as ``{"id", "template", "question", "answer"}`` dicts.

    Duplicated questions (rare) are dropped, so the list may be slightly shorter than ``count``.
    """
    problems, seen = [], set()
    for index in range(count):
        template, question, answer = gsm_problem(index)
        if question not in seen:
            seen.add(question)
            problems.append({"id": f"gsm-{index:05d}", "template": template, "question": question, "answer": answer})
    return problems
