"""Synthetic recall corpus for kvfence-tiny (shared by train_tiny.py and the eval fixture).

Grammar (all lower case, like the fixed record format):

    conversation := user(context SEP question) assistant(answer) { user(question) assistant(answer) }
    context      := item { JOIN item }            (JOIN = " " or "\n"; 100..1,000 bytes, curriculum)
    item         := record | distractor | filler
    record       := "the access code of account " ACCOUNT " is " CODE "."
    ACCOUNT      := 4 digits                        e.g. 4821
    CODE         := C C C "-" C C C, C in [A-Z0-9]  e.g. QX7-PL2
    distractor   := another kind of fact, often about an account number, e.g.
                    "the access code of locker 4821 is QX7-PL2." / "the pin of account 4821 is 7731."
                    / "account 4821 belongs to maria." / "the phone number of office 4821 is 555-0192."
    filler       := a random sentence from a small word grammar (may contain numbers)
    SEP          := " " | "\n" | "\n\n"
    question     := "What is the access code of account " ACCOUNT "?"
    answer       := record(ACCOUNT, CODE) when a record for ACCOUNT is in the context,
                    else "the access code of account " ACCOUNT " is not known."

The answer restates the whole record rather than the bare code. That makes answering the same act
as continuing a record line seen earlier in the context: after "...account 4821 is " the model
copies what followed the same words before (an induction copy), with the account's digits copied
from the question just above. A 2-layer model learns that within minutes; asked for the bare code,
the same model had to match the question's digits from 14+ tokens away and stayed at 0% exact
recall (docs/kvfence-tiny.md).

About 12% of questions ask for an account with no access-code record in the context (often an
account that does appear in a distractor), whose answer is "... is not known.".

Held-out split (by construction): an account number or a code is "held out" when a keyed CRC32 of
its text is 0 mod 10 (`is_heldout_account`, `is_heldout_code`). Training conversations only ever
use non-held-out accounts and codes (in records, distractors and questions); the eval prompts in
testing/fixtures/recall-prompts.json use only held-out accounts and held-out codes, and a separate
seed. So no (account, code) pair, account or code of the eval set is ever seen in training.

Tokens: bytes of UTF-8 text are ids 0..255; <|endoftext|>=256, <|im_start|>=257, <|im_end|>=258.
"""

import random
import re
import zlib

ENDOFTEXT, IM_START, IM_END = 256, 257, 258
VOCAB_SIZE = 264
CODE_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
UNKNOWN = "unknown"


def _h(kind, text):
    return zlib.crc32(f"kvfence-split/{kind}/{text}".encode()) % 10


def is_heldout_account(acct):
    return _h("account", acct) == 0


def is_heldout_code(code):
    return _h("code", code) == 0


def question(acct):
    return f"What is the access code of account {acct}?"


def record(acct, code):
    return f"the access code of account {acct} is {code}."


def answer_text(acct, code):
    """The assistant's reply: the record restated ("the access code of account 4821 is QX7-PL2."),
    or "... is not known." when the context has no record for the account."""
    return f"the access code of account {acct} is not known." if code == UNKNOWN else record(acct, code)


# ---- filler grammar -----------------------------------------------------------------------
SUBJ = ["the team", "our neighbor", "the old bridge", "a small dog", "the manager", "my sister",
        "the river", "the printer", "a tall tree", "the committee", "the bakery", "the train",
        "the new intern", "the garden", "an engineer", "the library", "the storm", "the museum",
        "the market", "a quiet student", "the city council", "the server room", "the orchestra"]
VERB = ["moved", "opened", "painted", "closed", "visited", "repaired", "watched", "cleaned",
        "planned", "ordered", "found", "lost", "built", "tested", "counted", "shipped", "reviewed",
        "carried", "measured", "described", "delayed", "approved", "noticed"]
OBJ = ["the blue door", "a long report", "the morning bus", "three boxes", "the spare keys",
       "a new roof", "the weekly menu", "the west window", "a paper map", "the budget",
       "the broken fence", "a wooden chair", "the invoices", "the garden hose", "two lamps",
       "the meeting notes", "a large table", "the backup drive", "the lunch order", "the plants"]
ADV = ["on tuesday", "before noon", "after the rain", "last week", "in the evening", "quickly",
       "without a word", "near the station", "for the third time", "at dawn", "in march",
       "during the holiday", "with some help", "again", "by the lake", "on floor {n}",
       "at {h}:{m2}", "in room {n3}", "for {n} hours", "in {y}"]
NAMES = ["maria", "li wei", "omar", "anna", "kofi", "sofia", "raj", "elena", "tom", "yuki",
         "ines", "david", "priya", "lars"]
KINDS_NUM = ["the pin of account {a} is {n4}.", "the phone number of office {a} is 555-{n4}.",
             "account {a} belongs to {name}.", "account {a} was opened in {y}.",
             "the balance of account {a} is {n3} dollars.", "the room of employee {a} is {n3}."]
KINDS_CODE = ["the access code of locker {a} is {c}.", "the access code of building {a} is {c}.",
              "the license key of account {a} is {c}.", "the door code of room {a} is {c}.",
              "the access code of account {a} is not known."]


def _fmt(rng, s, acct=None, code=None):
    return s.format(
        n=rng.randint(2, 12), h=rng.randint(1, 12), m2=f"{rng.randint(0, 59):02d}",
        n3=rng.randint(100, 999), n4=f"{rng.randint(0, 9999):04d}", y=rng.randint(1990, 2025),
        name=rng.choice(NAMES), a=acct, c=code)


def filler(rng):
    s = f"{rng.choice(SUBJ)} {rng.choice(VERB)} {rng.choice(OBJ)} {rng.choice(ADV)}."
    return _fmt(rng, s)


class Pools:
    """Account and code samplers restricted to one side of the held-out split."""

    def __init__(self, heldout):
        self.accounts = [f"{i:04d}" for i in range(10000) if is_heldout_account(f"{i:04d}") == heldout]
        self.heldout = heldout

    def account(self, rng):
        return rng.choice(self.accounts)

    def code(self, rng):
        while True:
            c = "".join(rng.choice(CODE_CHARS) for _ in range(3)) + "-" + \
                "".join(rng.choice(CODE_CHARS) for _ in range(3))
            if is_heldout_code(c) == self.heldout:
                return c


def near_account(rng, pools, acct):
    """An account of the same split that differs from `acct` in one or two digit places."""
    while True:
        d = list(acct)
        for k in rng.sample(range(4), rng.randint(1, 2)):
            d[k] = rng.choice("0123456789".replace(d[k], ""))
        a = "".join(d)
        if is_heldout_account(a) == pools.heldout:
            return a


def make_context(rng, pools, target_bytes, n_records_min=1, p_distract=0.15, p_dup=0.0, p_near=0.0,
                 p_record_max=0.5):
    """Returns (context_text, {account: code}, distractor_accounts).

    With p_dup > 0 each record is, with that probability, repeated once later in the context
    (training only: the repeated code is an extra copy target, see `encode_turns`). With p_near > 0
    a new record's account is, with that probability, a near miss of an earlier record's account
    (one or two digits changed; training only: it forces the answer to match all four digits)."""
    facts, dis_accts, items = {}, [], []
    size = 0
    p_record = rng.uniform(0.2, p_record_max)
    while size < target_bytes or len(facts) < n_records_min:
        u = rng.random()
        if u < p_record or len(facts) < n_records_min and size > target_bytes * 0.6:
            a = pools.account(rng)
            if p_near > 0 and facts and rng.random() < p_near:
                a = near_account(rng, pools, rng.choice(list(facts)))
            if a in facts:
                continue
            facts[a] = pools.code(rng)
            items.append(record(a, facts[a]))
        elif u < p_record + p_distract:
            a = pools.account(rng)
            if a in facts:
                continue
            tmpl = rng.choice(KINDS_NUM + KINDS_CODE)
            items.append(_fmt(rng, tmpl, acct=a, code=pools.code(rng)))
            dis_accts.append(a)
        else:
            items.append(filler(rng))
        size += len(items[-1]) + 1
    # the record positions are already random; shuffle lightly so the first item is not special
    rng.shuffle(items)
    if p_dup > 0:
        for it in [it for it in items if it.startswith("the access code of account ")]:
            if it[27:31] in facts and rng.random() < p_dup:
                items.insert(rng.randint(items.index(it) + 1, len(items)), it)
    out = items[0]
    for it in items[1:]:
        out += rng.choice([" ", " ", "\n"]) + it
    return out, facts, [a for a in dis_accts if a not in facts]


def make_conversation(rng, pools, target_bytes, n_questions, p_unknown=0.12, p_dup=0.0, p_near=0.0,
                      p_record_max=0.5):
    ctx, facts, dis = make_context(rng, pools, target_bytes, p_dup=p_dup, p_near=p_near,
                                   p_record_max=p_record_max)
    keys = list(facts)
    rng.shuffle(keys)
    qs = []
    for _ in range(n_questions):
        if rng.random() < p_unknown:
            while True:
                a = rng.choice(dis) if dis and rng.random() < 0.5 else pools.account(rng)
                if a not in facts:
                    break
            qs.append((a, UNKNOWN))
        else:
            a = keys[len(qs) % len(keys)] if len(qs) < len(keys) else rng.choice(keys)
            qs.append((a, facts[a]))
    sep = rng.choice([" ", "\n", "\n\n"])
    turns = []
    for i, (a, ans) in enumerate(qs):
        user = (ctx + sep + question(a)) if i == 0 else question(a)
        turns.append((user, ans))
    return turns


def encode_text(s):
    return list(s.encode("utf-8"))


RECORD_RE = re.compile(r"the access code of account (\d{4}) is ([A-Z0-9]{3}-[A-Z0-9]{3})\.")


def repeat_mask(user):
    """1 on the code bytes of a record that repeats an earlier record of the same text, else 0."""
    mask, seen = [0] * len(user.encode("utf-8")), set()
    for m in RECORD_RE.finditer(user):
        if m.group(0) in seen:
            for k in range(m.start(2), m.end(2)):
                mask[k] = 1
        seen.add(m.group(0))
    return mask


def encode_turns(turns, with_repeats=False):
    """ChatML token ids and per-token flags: 1 on answer bytes + <|im_end|>, else 0; with
    with_repeats also the flags of repeated-record codes in user turns (see `repeat_mask`)."""
    ids, ans, rep = [], [], []
    for user, answer in turns:
        u = [IM_START] + encode_text("user\n" + user) + [IM_END] + encode_text("\n")
        a0 = [IM_START] + encode_text("assistant\n")
        a1 = encode_text(answer) + [IM_END]
        ids += u + a0 + a1 + encode_text("\n")
        ans += [0] * (len(u) + len(a0)) + [1] * len(a1) + [0]
        if with_repeats:
            rep += [0] * 6 + repeat_mask(user) + [0] * (len(u) - 6 - len(user.encode()) + len(a0) + len(a1) + 1)
    return (ids, ans, rep) if with_repeats else (ids, ans)


def encode_prompt(user):
    """Single-turn prompt with the generation prompt, as the chat template renders it."""
    return [IM_START] + encode_text("user\n" + user) + [IM_END] + encode_text("\n") + \
        [IM_START] + encode_text("assistant\n")


def make_eval_prompts(seed, n, min_bytes=100, max_bytes=1000):
    rng = random.Random(seed)
    pools = Pools(heldout=True)
    out = []
    for _ in range(n):
        target = rng.randint(min_bytes, max_bytes - 50)
        while True:
            ctx, facts, _ = make_context(rng, pools, target)
            if min_bytes <= len(ctx.encode()) <= max_bytes:
                break
        a = rng.choice(list(facts))
        sep = rng.choice([" ", "\n", "\n\n"])
        out.append({"messages": [{"role": "user", "content": ctx + sep + question(a)}],
                    "expected": facts[a], "answer": answer_text(a, facts[a])})
    return out


if __name__ == "__main__":
    # Writes the held-out eval fixture: python3 scripts/corpus.py testing/fixtures/recall-prompts.json
    import json
    import sys

    path = sys.argv[1] if len(sys.argv) > 1 else "testing/fixtures/recall-prompts.json"
    prompts = make_eval_prompts(seed=20261129, n=200)
    with open(path, "w") as f:
        json.dump({"format": 1, "prompts": prompts}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(prompts)} prompts to {path}")
