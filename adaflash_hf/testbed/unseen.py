"""A fifth kind of traffic no drafter of ours was trained on: text-to-SQL requests.

OnlineSpec's claim is about traffic the drafter never saw. Our drafters learn from the four testbed domains
(code = Python from HumanEval and the standard library, math, chat = English ShareGPT / MT-Bench, prose =
Shakespeare); 4 of the label store's 5,248 target responses contain `SELECT`. SQL is a shift for the drafter but
not for the target: SmolLM2's pre-training mix (The Stack / StarCoder data) holds plenty of SQL, and the target
answers these requests with fenced SQL queries.

Each request names one table with its columns and asks for one query in plain English (select with a filter,
aggregate per group, join, top-k, insert, update, delete, create table). The table and column vocabulary and the
values (cities, names, companies, jobs, dates) come from `faker` (a pure-Python package from PyPI, seeded, so the
stream is the same on every machine); the sentence templates are ours. Records follow the testbed's prompt
format: `{"prompt", "domain": "sql", "source": "faker-sql", "id"}`.
"""

from __future__ import annotations

import random

from ..utils.extras import require


DOMAIN = "sql"
SOURCE = "faker-sql"

TABLES = {
    "customers": ["id", "name", "email", "city", "country", "signup_date"],
    "orders": ["id", "customer_id", "product_id", "quantity", "total", "order_date"],
    "employees": ["id", "name", "job", "department", "salary", "hire_date", "city"],
    "products": ["id", "name", "category", "price", "stock", "supplier"],
    "suppliers": ["id", "company", "country", "phone", "rating"],
    "invoices": ["id", "customer_id", "amount", "due_date", "paid"],
}
# table -> (the table it joins with, the join condition in words)
JOINS = {"orders": ("customers", "customer_id = customers.id"), "invoices": ("customers", "customer_id = customers.id"),
         "products": ("suppliers", "supplier = suppliers.company")}
CATEGORIES = ["books", "toys", "garden", "kitchen", "sports", "music", "office", "beauty"]
DEPARTMENTS = ["sales", "marketing", "engineering", "finance", "support", "legal"]


def _value(fake, table: str, column: str):
    """A plausible literal for `table.column`."""
    if column in ("city",):
        return fake.city()
    if column == "country":
        return fake.country()
    if column in ("name",) and table == "products":
        return fake.word().capitalize() + " " + rng_choice(fake, ["Lamp", "Chair", "Mug", "Kit", "Set", "Pen"])
    if column == "name":
        return fake.name()
    if column == "email":
        return fake.email()
    if column == "job":
        return fake.job()
    if column == "department":
        return rng_choice(fake, DEPARTMENTS)
    if column == "category":
        return rng_choice(fake, CATEGORIES)
    if column in ("company", "supplier"):
        return fake.company()
    if column.endswith("_date"):
        return fake.date_between(start_date="-5y", end_date="today").isoformat()
    if column in ("salary", "amount", "total", "price"):
        return fake.random_int(10, 900) * (100 if column == "salary" else 1)
    if column in ("quantity", "stock", "rating"):
        return fake.random_int(1, 50 if column != "rating" else 5)
    if column == "paid":
        return rng_choice(fake, ["true", "false"])
    return fake.random_int(1, 5000)


def rng_choice(fake, options):
    return options[fake.random_int(0, len(options) - 1)]


def _schema(table: str) -> str:
    return f"Table `{table}` has the columns {', '.join(TABLES[table])}."


NUMERIC = ("salary", "amount", "total", "price", "quantity", "stock", "rating")
TEXTUAL = ("city", "country", "job", "department", "category", "supplier", "company", "paid")


def _request(fake, rnd: random.Random) -> str:
    """One English request for one SQL statement."""
    table = rnd.choice(sorted(TABLES))
    cols = TABLES[table]
    numeric = [c for c in cols if c in NUMERIC] or ["id"]
    shown = [c for c in cols if c != "id"]
    textual = [c for c in cols if c in TEXTUAL] or [c for c in shown if c not in NUMERIC]
    kinds = ["filter", "aggregate", "top", "insert", "update", "delete", "create", "between"]
    kind = rnd.choice(kinds + (["join"] if table in JOINS else []))
    n, t = rnd.choice(numeric), rnd.choice(textual)
    if kind == "filter":
        a, b = rnd.sample(shown, 2)
        ask = f"Write a SQL query that returns the {a} and {b} of every row whose {t} is '{_value(fake, table, t)}'."
    elif kind == "aggregate":
        fn = rnd.choice(["average", "total", "maximum", "number of rows"])
        what = "the number of rows" if fn == "number of rows" else f"the {fn} {n}"
        ask = f"Write a SQL query that computes {what} per {t}, sorted from largest to smallest."
    elif kind == "top":
        k = rnd.randint(3, 20)
        other = rnd.choice([c for c in shown if c != n])
        ask = f"Write a SQL query that lists the {k} rows with the highest {n}, showing {other} and {n}."
    elif kind == "join":
        other, key = JOINS[table]
        ask = (f"{_schema(other)} Write a SQL query that joins `{table}` with `{other}` on {key} and returns, for "
               f"each {other.rstrip('s')}, the number of matching {table}.")
    elif kind == "insert":
        values = ", ".join(f"{c} = {_value(fake, table, c)!r}" for c in shown)
        ask = f"Write a SQL statement that inserts a new row with {values}."
    elif kind == "update":
        n = n if n != "id" else next(c for c in shown if c != t)
        ask = (f"Write a SQL statement that sets {n} to {_value(fake, table, n)!r} for every row whose {t} is "
               f"'{_value(fake, table, t)}'.")
    elif kind == "delete":
        date = next((c for c in cols if c.endswith("_date")), None)
        cond = f"{date} is before {_value(fake, table, date)}" if date else f"{n} is below {_value(fake, table, n)}"
        ask = f"Write a SQL statement that deletes every row whose {cond}."
    elif kind == "between":
        lo = _value(fake, table, n)
        ask = (f"Write a SQL query that returns every {rnd.choice([c for c in shown if c != n])} whose {n} lies between {lo} and "
               f"{lo * 2 + 1}, ordered by {n}.")
    else:
        return (f"Write the SQL CREATE TABLE statement for a table `{table}` with the columns "
                f"{', '.join(cols)}, choosing a sensible type for each column and `id` as the primary key.")
    return f"{_schema(table)} {ask}"


def sql_requests(count: int, seed: int = 0) -> list[dict]:
    """`count` distinct text-to-SQL requests (testbed prompt records, domain `"sql"`), the same for a seed."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    require("the text-to-SQL stream", "faker")
    from faker import Faker

    fake = Faker("en_US")
    fake.seed_instance(seed)
    rnd = random.Random(seed)
    seen, records = set(), []
    for _ in range(50 * count):
        prompt = _request(fake, rnd)
        if prompt not in seen:
            seen.add(prompt)
            records.append({"prompt": prompt, "domain": DOMAIN, "source": SOURCE, "id": f"{seed}-{len(records)}"})
            if len(records) == count:
                return records
    raise RuntimeError(f"only {len(records)} distinct requests after {50 * count} tries")


def unseen_stream(unseen: int = 200, known: int = 50, seed: int = 0) -> list[dict]:
    """OnlineSpec's setting: `unseen` text-to-SQL requests, then `known` held-out (eval-split) prompts of the four
    training domains in round-robin order (does the adapter forget what the drafter knew?)."""
    from .prompts import DOMAINS, load_prompts

    if known < 0:
        raise ValueError(f"known must be >= 0, got {known}")
    tail = load_prompts(split="eval", max_per_domain=-(-known // len(DOMAINS)), seed=seed)[:known] if known else []
    return sql_requests(unseen, seed=seed) + tail


__all__ = ["DOMAIN", "SOURCE", "sql_requests", "unseen_stream"]
