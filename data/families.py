"""families.py: the 8 template families of tasks.py's generator (arithmetic, strings, lists,
conditionals, loops, dicts, algorithms, compose), as data: one `_v(...)` line per variant.

A variant is a template: name/doc/body are str.format templates whose slots ({x}, {xs}, ...) become
argument names and whose params ({c}, ...) are constants stated plainly in the docstring, so a tiny
model can learn to copy them. Outputs are computed by running the reference body (trusted code) on
sampled inputs (tasks.py builds the tasks; world.py is the ninth, compositional family).

    python -c "from data import families; print(len(families.VARIANTS), sorted({v.family for v in families.VARIANTS}))"

Stdlib only; imports nothing from the project (tasks.py and world.py import it).
"""
import dataclasses
import hashlib
import itertools
import random
import re

LETTERS = "abcdeilmnorst"
VOCAB = "apple bee cat dog egg fig red blue sun moon tree sky car box pen ink".split()
_SUFFIX = ["ing", "ed", "er", "ly", "s", "est", "ful", "ness"]
PAIRS = [("big", "small"), ("high", "low"), ("yes", "no"), ("hot", "cold"), ("pass", "fail"), ("up", "down")]
_TRIPLES = [("low", "medium", "high"), ("cold", "warm", "hot"), ("small", "medium", "large"),
            ("short", "average", "tall")]
_XS = ("nums", "values", "numbers", "items", "xs", "data")
_WS = ("words", "names", "strings", "tokens")
_DS = ("d", "counts", "scores", "table")


def R(a, b):
    return list(range(a, b + 1))


class Random(random.Random):
    """random.Random with randint/choice from one random() call each: 3x faster than the stdlib's
    rejection sampling (bias < 2**-40), which dominated generating 50,000 tasks."""
    def randint(self, a, b):
        return a + int(self.random() * (b - a + 1))

    def choice(self, seq):
        return seq[int(self.random() * len(seq))]


def _word(r, lo=0, hi=7):
    return "".join(r.choice(LETTERS) for _ in range(r.randint(lo, hi)))


def _ints(r, lo, hi, a=-9, b=30):
    return [r.randint(a, b) for _ in range(r.randint(lo, hi))]


def _pal(r):
    w = _word(r, 0, 4)
    return r.choice([w + w[::-1], w + w[-2::-1], _word(r, 1, 6)])


def _dict(r, lo):
    return {r.choice(VOCAB): r.randint(0, 20) for _ in range(r.randint(lo, 5))}


SLOTS = {  # slot -> (argument names to pick from, input sampler)
    "x": (("x", "num", "value", "a"), lambda r: r.randint(-20, 50)),
    "y": (("y", "other", "b", "m"), lambda r: r.randint(-20, 50)),
    "n": (("n", "k", "limit", "size"), lambda r: r.randint(0, 12)),
    "m": (("n", "num", "start", "k"), lambda r: r.randint(1, 60)),
    "big": (("n", "num", "number", "value"), lambda r: r.choice([r.randint(0, 99), r.randint(0, 99999)])),
    "age": (("age", "years", "person_age"), lambda r: r.randint(0, 90)),
    "score": (("score", "points", "mark"), lambda r: r.randint(0, 100)),
    "year": (("year", "y", "n"),
             lambda r: r.choice([r.randint(1800, 2400), 100 * r.randint(18, 24), 4 * r.randint(450, 600)])),
    "flag": (("weekend", "member", "holiday"), lambda r: r.random() < 0.5),
    "p": (("a", "x", "first"), lambda r: r.randint(1, 100)),
    "q": (("b", "y", "second"), lambda r: r.randint(1, 100)),
    "t": (("target", "wanted", "goal"), lambda r: r.randint(0, 12)),
    "s": (("s", "text", "word", "string"), _word),
    "pal": (("s", "text", "word", "string"), _pal),
    "bits": (("bits", "binary", "digits"), lambda r: "".join(r.choice("01") for _ in range(r.randint(1, 8)))),
    "sen": (("sentence", "text", "line", "phrase"),
            lambda r: " ".join(r.choice(VOCAB) for _ in range(r.randint(1, 5)))),
    "xs": (_XS, lambda r: _ints(r, 0, 8)),
    "xs1": (_XS, lambda r: _ints(r, 1, 8)),
    "ds": (_XS, lambda r: _ints(r, 0, 8, 0, 9)),
    "mxs": (_XS, lambda r: sorted(_ints(r, 0, 7)) if r.random() < 0.5 else _ints(r, 0, 7)),
    "sa": (_XS, lambda r: sorted(_ints(r, 0, 6))),
    "sb": (("others", "more", "second"), lambda r: sorted(_ints(r, 0, 6))),
    "inc": (_XS, lambda r: sorted(set(_ints(r, 0, 9, 0, 40)))),
    "ws": (_WS, lambda r: [r.choice(VOCAB) for _ in range(r.randint(0, 6))]),
    "ws1": (_WS, lambda r: [r.choice(VOCAB) for _ in range(r.randint(1, 6))]),
    "d": (_DS, lambda r: _dict(r, 0)),
    "d1": (_DS, lambda r: _dict(r, 1)),
    "e": (("other", "extra", "updates"), lambda r: _dict(r, 0)),
}
_Variant = dataclasses.make_dataclass("_Variant", ["family", "difficulty", "name", "sig", "doc", "body", "params",
                                                  "novel", "where"])
VARIANTS = []


def _v(family, difficulty, name, sig, doc, body, novel=False, where=None, **params):
    """Register a variant. novel=True: the whole template exists only in the test split (slice `novel`)."""
    VARIANTS.append(_Variant(family, difficulty, name, tuple(sig.split()), doc, body, params, novel, where))


_v("arithmetic", 1, "add_{c}", "x", "Return {x} plus {c}.", "return {x} + {c}", c=R(1, 99))
_v("arithmetic", 1, "subtract_{c}", "x", "Return {x} minus {c}.", "return {x} - {c}", c=R(1, 99))
_v("arithmetic", 1, "times_{c}", "x", "Return {x} times {c}.", "return {x} * {c}", c=R(2, 30))
_v("arithmetic", 1, "add_numbers", "x y", "Return the sum of {x} and {y}.", "return {x} + {y}")
_v("arithmetic", 2, "times_{a}_plus_{b}", "x", "Return {x} times {a} plus {b}.", "return {x} * {a} + {b}", a=R(2, 12),
   b=R(1, 30))
_v("arithmetic", 2, "div_by_{c}", "x", "Return {x} divided by {c}, rounded down.", "return {x} // {c}", c=R(2, 12))
_v("arithmetic", 2, "mod_{c}", "x", "Return the remainder of {x} divided by {c}.", "return {x} % {c}", c=R(2, 12))
_v("arithmetic", 2, "square_plus_{c}", "x", "Return the square of {x} plus {c}.", "return {x} * {x} + {c}", c=R(1, 50))
_v("arithmetic", 2, "last_digit", "big", "Return the last digit of {big}.", "return {big} % 10")
_v("arithmetic", 3, "add_{a}_then_times_{b}", "x", "Add {a} to {x}, then multiply the result by {b}.",
   "return ({x} + {a}) * {b}", a=R(1, 20), b=R(2, 9))
_v("arithmetic", 3, "distance_to_{c}", "x", "Return the distance between {x} and {c}.", "return abs({x} - {c})",
   c=R(0, 50))
_v("arithmetic", 3, "spread", "x y", "Return the larger of {x} and {y} minus the smaller.",
   "return max({x}, {y}) - min({x}, {y})")
_v("strings", 1, "to_upper", "s", "Return {s} in upper case.", "return {s}.upper()")
_v("strings", 1, "reverse_string", "s", "Return {s} reversed.", "return {s}[::-1]")
_v("strings", 1, "repeat_{c}_times", "s", "Return {s} repeated {c} times.", "return {s} * {c}", c=R(2, 5))
_v("strings", 1, "add_suffix_{w}", "s", "Return {s} followed by '{w}'.", "return {s} + '{w}'", w=_SUFFIX)
_v("strings", 1, "add_prefix_{w}", "s", "Return '{w}' followed by {s}.", "return '{w}' + {s}", w=_SUFFIX)
_v("strings", 1, "string_length", "s", "Return the number of characters in {s}.", "return len({s})")
_v("strings", 2, "first_{c}_chars", "s", "Return the first {c} characters of {s}.", "return {s}[:{c}]", c=R(1, 6))
_v("strings", 2, "last_{c}_chars", "s", "Return the last {c} characters of {s}.", "return {s}[-{c}:]", c=R(1, 6))
_v("strings", 2, "count_{ch}", "s", "Return how many times '{ch}' occurs in {s}.", "return {s}.count('{ch}')",
   ch=list(LETTERS))
_v("strings", 2, "replace_{a}_with_{b}", "s", "Return {s} with every '{a}' replaced by '{b}'.",
   "return {s}.replace('{a}', '{b}')", where=lambda p: p["a"] != p["b"], a=list(LETTERS), b=list(LETTERS))
_v("strings", 2, "remove_{ch}", "s", "Return {s} without any '{ch}'.", "return {s}.replace('{ch}', '')", ch=list(LETTERS))
_v("strings", 2, "starts_with_{ch}", "s", "Return True if {s} starts with '{ch}', otherwise False.",
   "return {s}.startswith('{ch}')", ch=list(LETTERS))
_v("strings", 3, "count_vowels", "s", "Return the number of vowels (a, e, i, o, u) in {s}.",
   "count = 0\nfor ch in {s}:\n    if ch in 'aeiou':\n        count += 1\nreturn count")
_v("strings", 3, "count_{w}_chars", "s", "Return how many characters of {s} are one of '{w}'.",
   "count = 0\nfor ch in {s}:\n    if ch in '{w}':\n        count += 1\nreturn count",
   w=["".join(c) for c in itertools.combinations(LETTERS, 2)])
_v("strings", 3, "reverse_words", "sen", "Return the words of {sen} in reverse order, separated by single spaces.",
   "return ' '.join({sen}.split()[::-1])")
_v("strings", 3, "is_palindrome", "pal", "Return True if {pal} reads the same forwards and backwards, otherwise False.",
   "return {pal} == {pal}[::-1]")
_v("strings", 3, "capitalize_words", "sen", "Return {sen} with the first letter of every word in upper case.",
   "return ' '.join(w.capitalize() for w in {sen}.split())")
_v("strings", 4, "shift_letters_{c}", "s",
   "Shift every letter of {s} forward by {c} places in the alphabet (after 'z' comes 'a').",
   "result = ''\nfor ch in {s}:\n    result += chr((ord(ch) - ord('a') + {c}) % 26 + ord('a'))\nreturn result",
   novel=True, c=R(1, 25))
_v("strings", 4, "alternate_case", "s",
   "Return {s} with the characters at even positions (0, 2, 4, ...) in upper case.",
   "result = ''\nfor i in range(len({s})):\n    if i % 2 == 0:\n        result += {s}[i].upper()\n    else:\n        "
   "result += {s}[i]\nreturn result")
_v("strings", 4, "longest_word", "sen",
   "Return the longest word in {sen}. If several words are equally long, return the first one.",
   "best = ''\nfor w in {sen}.split():\n    if len(w) > len(best):\n        best = w\nreturn best")
_v("strings", 4, "first_repeated_char", "s",
   "Return the first character of {s} that already appeared before it, or '' if there is none.",
   "seen = ''\nfor ch in {s}:\n    if ch in seen:\n        return ch\n    seen += ch\nreturn ''")
_v("strings", 5, "run_length_encode", "s",
   "Return the run-length encoding of {s}: every run of equal characters becomes the character followed by the "
   "length of the run.",
   "result = ''\ni = 0\nwhile i < len({s}):\n    j = i\n    while j < len({s}) and {s}[j] == {s}[i]:\n        j += "
   "1\n    result += {s}[i] + str(j - i)\n    i = j\nreturn result")
_v("strings", 5, "most_common_char", "s",
   "Return the character that occurs most often in {s}; on a tie, the one that comes first. Return '' for an empty "
   "string.",
   "best = ''\nfor ch in {s}:\n    if best == '' or {s}.count(ch) > {s}.count(best):\n        best = ch\nreturn best")
for fn, nm, doc in [("sum", "total", "the sum of the numbers in {xs1}"),
                    ("max", "largest", "the largest number in {xs1}"),
                    ("min", "smallest", "the smallest number in {xs1}"),
                    ("len", "count_items", "the number of items in {xs1}"),
                    ("sorted", "sort_numbers", "the numbers in {xs1} sorted from smallest to largest")]:
    _v("lists", 1, nm, "xs1", f"Return {doc}.", f"return {fn}({{xs1}})")
_v("lists", 1, "first_item", "xs1", "Return the first item of {xs1}.", "return {xs1}[0]")
_v("lists", 1, "last_item", "xs1", "Return the last item of {xs1}.", "return {xs1}[-1]")
_v("lists", 2, "add_{c}_to_each", "xs", "Return a new list with {c} added to every number in {xs}.",
   "return [x + {c} for x in {xs}]", c=R(1, 20))
_v("lists", 2, "multiply_each_by_{c}", "xs", "Return a new list with every number in {xs} multiplied by {c}.",
   "return [x * {c} for x in {xs}]", c=R(2, 10))
_v("lists", 2, "first_{c}_items", "xs", "Return the first {c} items of {xs}.", "return {xs}[:{c}]", c=R(1, 6))
_v("lists", 2, "sort_descending", "xs", "Return the numbers in {xs} sorted from largest to smallest.",
   "return sorted({xs}, reverse=True)")
_v("lists", 2, "count_{c}s", "ds", "Return how many times {c} occurs in {ds}.", "return {ds}.count({c})", c=R(0, 9))
_v("lists", 2, "contains_{c}", "ds", "Return True if {c} is in {ds}, otherwise False.", "return {c} in {ds}", c=R(0, 9))
_v("lists", 3, "keep_above_{c}", "xs", "Return the numbers in {xs} that are greater than {c}, in their original order.",
   "return [x for x in {xs} if x > {c}]", c=R(0, 20))
_v("lists", 3, "keep_multiples_of_{c}", "xs",
   "Return the numbers in {xs} that are divisible by {c}, in their original order.",
   "return [x for x in {xs} if x % {c} == 0]", c=R(2, 6))
_v("lists", 3, "sum_above_{c}", "xs", "Return the sum of the numbers in {xs} that are greater than {c}.",
   "total = 0\nfor x in {xs}:\n    if x > {c}:\n        total += x\nreturn total", c=R(0, 20))
_v("lists", 3, "average", "xs1", "Return the average (arithmetic mean) of the numbers in {xs1}.",
   "return sum({xs1}) / len({xs1})")
_v("lists", 3, "count_even", "xs", "Return how many numbers in {xs} are even.",
   "count = 0\nfor x in {xs}:\n    if x % 2 == 0:\n        count += 1\nreturn count")
_v("lists", 4, "running_total", "xs",
   "Return the running totals of {xs}: item i is the sum of the first i + 1 numbers.",
   "total = 0\nresult = []\nfor x in {xs}:\n    total += x\n    result.append(total)\nreturn result")
_v("lists", 4, "differences", "xs",
   "Return the list of differences between each number in {xs} and the number before it.",
   "return [{xs}[i] - {xs}[i - 1] for i in range(1, len({xs}))]")
_v("lists", 4, "remove_duplicates", "ds",
   "Return {ds} without repeated numbers, keeping the first occurrence of each in order.",
   "seen = []\nfor x in {ds}:\n    if x not in seen:\n        seen.append(x)\nreturn seen")
_v("lists", 4, "index_of_max", "xs1",
   "Return the position of the largest number in {xs1}; if it occurs several times, the first position.",
   "best = 0\nfor i in range(1, len({xs1})):\n    if {xs1}[i] > {xs1}[best]:\n        best = i\nreturn best")
_v("lists", 4, "rotate_left_{c}", "xs1",
   "Return {xs1} rotated left by {c} places: items taken from the front go to the back.",
   "k = {c} % len({xs1})\nreturn {xs1}[k:] + {xs1}[:k]", c=R(1, 9))
_v("lists", 4, "chunks_of_{c}", "xs",
   "Split {xs} into consecutive chunks of {c} numbers (the last one may be shorter) and return the list of chunks.",
   "return [{xs}[i:i + {c}] for i in range(0, len({xs}), {c})]", novel=True, c=R(2, 4))
_v("lists", 5, "longest_increasing_run", "xs1",
   "Return the length of the longest run of consecutive, strictly increasing numbers in {xs1}.",
   "best = 1\ncurrent = 1\nfor i in range(1, len({xs1})):\n    if {xs1}[i] > {xs1}[i - 1]:\n        current += 1\n   "
   " else:\n        current = 1\n    if current > best:\n        best = current\nreturn best")
_v("lists", 5, "merge_sorted", "sa sb", "Merge the sorted lists {sa} and {sb} into one sorted list.",
   "result = []\ni = 0\nj = 0\nwhile i < len({sa}) and j < len({sb}):\n    if {sa}[i] <= {sb}[j]:\n        "
   "result.append({sa}[i])\n        i += 1\n    else:\n        result.append({sb}[j])\n        j += 1\nreturn result "
   "+ {sa}[i:] + {sb}[j:]")
for op, word, nm in [(">", "greater than", "greater"), ("<", "less than", "less"), (">=", "at least", "at_least"),
                     ("<=", "at most", "at_most")]:
    _v("conditionals", 1, f"is_{nm}_{{c}}", "x", f"Return True if {{x}} is {word} {{c}}, otherwise False.",
       f"return {{x}} {op} {{c}}", c=R(0, 40))
_v("conditionals", 1, "is_even", "x", "Return True if {x} is even, otherwise False.", "return {x} % 2 == 0")
_v("conditionals", 1, "is_odd", "x", "Return True if {x} is odd, otherwise False.", "return {x} % 2 == 1")
_v("conditionals", 1, "is_divisible_by_{c}", "x", "Return True if {x} is divisible by {c}, otherwise False.",
   "return {x} % {c} == 0", c=R(2, 12))
_v("conditionals", 2, "{a}_or_{b}_{c}", "x", "Return '{a}' if {x} is greater than {c}, otherwise '{b}'.",
   "if {x} > {c}:\n    return '{a}'\nreturn '{b}'", **{"a,b": PAIRS, "c": R(0, 30)})
_v("conditionals", 2, "positive_or_zero", "x", "Return {x} if it is positive, otherwise 0.",
   "if {x} > 0:\n    return {x}\nreturn 0")
_v("conditionals", 3, "{a}_{b}_{c}", "x",
   "Return '{a}' if {x} is less than {lo}, '{c}' if {x} is greater than {hi}, and '{b}' otherwise.",
   "if {x} < {lo}:\n    return '{a}'\nif {x} > {hi}:\n    return '{c}'\nreturn '{b}'",
   **{"a,b,c": _TRIPLES, "lo": R(-5, 15), "hi": R(16, 40)})
_v("conditionals", 3, "clamp_{lo}_{hi}", "x",
   "Return {x} limited to the range {lo} to {hi}: smaller values become {lo}, larger values become {hi}.",
   "if {x} < {lo}:\n    return {lo}\nif {x} > {hi}:\n    return {hi}\nreturn {x}", lo=R(0, 15), hi=R(16, 40))
_v("conditionals", 3, "sign_word", "x",
   "Return 'negative' if {x} is below zero, 'zero' if it is zero, and 'positive' otherwise.",
   "if {x} < 0:\n    return 'negative'\nif {x} == 0:\n    return 'zero'\nreturn 'positive'")
_v("conditionals", 4, "say_{wa}_{wb}", "x",
   "Return '{wa}{wb}' if {x} is divisible by both {a} and {b}, '{wa}' if only by {a}, '{wb}' if only by {b}, and "
   "otherwise {x} as a string.",
   "if {x} % {a} == 0 and {x} % {b} == 0:\n    return '{wa}{wb}'\nif {x} % {a} == 0:\n    return '{wa}'\nif {x} % "
   "{b} == 0:\n    return '{wb}'\nreturn str({x})", where=lambda p: p["a"] < p["b"],
   **{"wa,wb": [("fizz", "buzz"), ("ping", "pong"), ("foo", "bar"), ("tic", "tac")], "a": R(2, 5), "b": R(3, 7)})
_v("conditionals", 4, "letter_grade", "score",
   "Return the grade for {score}: 'A' for {a} or more, 'B' for {b} or more, 'C' for {c} or more, and 'F' otherwise.",
   "if {score} >= {a}:\n    return 'A'\nif {score} >= {b}:\n    return 'B'\nif {score} >= {c}:\n    return 'C'\n"
   "return 'F'", a=R(80, 95), b=R(60, 79), c=R(40, 59))
_v("conditionals", 4, "is_leap_year", "year",
   "Return True if {year} is a leap year: divisible by 4, except years divisible by 100, which must also be "
   "divisible by 400.",
   "if {year} % 400 == 0:\n    return True\nif {year} % 100 == 0:\n    return False\nreturn {year} % 4 == 0")
_v("conditionals", 5, "ticket_price", "age flag",
   "Return the ticket price for age {age}: {p1} below age {a}, {p2} from age {b} on, {p3} otherwise; add {d} when "
   "{flag} is True.",
   "if {age} < {a}:\n    price = {p1}\nelif {age} >= {b}:\n    price = {p2}\nelse:\n    price = {p3}\nif {flag}:\n   "
   " price += {d}\nreturn price", a=R(5, 17), b=R(60, 70), p1=R(1, 9), p2=R(3, 12), p3=R(10, 25), d=R(1, 5))
_v("loops", 2, "sum_up_to", "n", "Return the sum of the whole numbers from 1 to {n}.",
   "total = 0\nfor i in range(1, {n} + 1):\n    total += i\nreturn total")
_v("loops", 2, "count_by_{c}", "m", "Return the list of numbers from 0 up to, but not including, {m}, counting by {c}.",
   "return list(range(0, {m}, {c}))", c=R(2, 9))
_v("loops", 3, "product_up_to", "n", "Return the product of the whole numbers from 1 to {n}.",
   "result = 1\nfor i in range(1, {n} + 1):\n    result *= i\nreturn result")
_v("loops", 3, "sum_of_powers_{c}", "n", "Return the sum of i ** {c} for every i from 1 to {n}.",
   "total = 0\nfor i in range(1, {n} + 1):\n    total += i ** {c}\nreturn total", c=R(2, 4))
_v("loops", 3, "count_multiples_of_{c}", "m", "Return how many whole numbers from 1 to {m} are divisible by {c}.",
   "count = 0\nfor i in range(1, {m} + 1):\n    if i % {c} == 0:\n        count += 1\nreturn count", c=R(2, 9))
_v("loops", 4, "digit_sum", "big", "Return the sum of the digits of {big}.",
   "total = 0\nwhile {big} > 0:\n    total += {big} % 10\n    {big} //= 10\nreturn total")
_v("loops", 4, "count_digits", "big", "Return how many digits {big} has.",
   "count = 1\nwhile {big} >= 10:\n    {big} //= 10\n    count += 1\nreturn count")
_v("loops", 4, "powers_of_{c}", "n", "Return the list of the first {n} powers of {c}, starting with 1.",
   "result = []\nvalue = 1\nfor _ in range({n}):\n    result.append(value)\n    value *= {c}\nreturn result", c=R(2, 5))
_v("loops", 5, "collatz_steps", "m",
   "Starting from {m}, repeatedly halve the number if it is even, or else triple it and add 1. Return how many steps "
   "it takes to reach 1.",
   "steps = 0\nwhile {m} != 1:\n    if {m} % 2 == 0:\n        {m} = {m} // 2\n    else:\n        {m} = 3 * {m} + 1\n "
   "   steps += 1\nreturn steps")
_v("loops", 5, "reverse_digits", "big", "Return the number whose digits are the digits of {big} in reverse order.",
   "result = 0\nwhile {big} > 0:\n    result = result * 10 + {big} % 10\n    {big} //= 10\nreturn result")
_v("loops", 5, "to_base_{c}", "big", "Return {big} written in base {c}, as a string of digits.",
   "if {big} == 0:\n    return '0'\ndigits = ''\nwhile {big} > 0:\n    digits = str({big} % {c}) + digits\n    {big} "
   "//= {c}\nreturn digits", c=R(2, 9))
_v("dicts", 1, "count_keys", "d", "Return the number of keys in {d}.", "return len({d})")
_v("dicts", 1, "sum_values", "d", "Return the sum of the values in {d}.", "return sum({d}.values())")
_v("dicts", 2, "get_{k}_or_{c}", "d", "Return the value stored under '{k}' in {d}, or {c} if '{k}' is not a key.",
   "return {d}.get('{k}', {c})", k=VOCAB, c=R(0, 9))
_v("dicts", 2, "sorted_keys", "d", "Return the keys of {d} in sorted order.", "return sorted({d})")
_v("dicts", 2, "word_lengths", "ws", "Return a dictionary that maps each word in {ws} to its length.",
   "return {{w: len(w) for w in {ws}}}")
_v("dicts", 2, "add_{c}_to_values", "d", "Return a new dictionary with the keys of {d} and {c} added to every value.",
   "return {{k: v + {c} for k, v in {d}.items()}}", c=R(1, 20))
_v("dicts", 3, "count_chars", "s",
   "Return a dictionary that maps each character of {s} to the number of times it occurs.",
   "counts = {{}}\nfor ch in {s}:\n    counts[ch] = counts.get(ch, 0) + 1\nreturn counts")
_v("dicts", 3, "keys_above_{c}", "d", "Return the sorted list of keys in {d} whose value is greater than {c}.",
   "return sorted(k for k in {d} if {d}[k] > {c})", c=R(0, 15))
_v("dicts", 3, "count_words", "ws", "Return a dictionary that maps each word in {ws} to the number of times it occurs.",
   "counts = {{}}\nfor w in {ws}:\n    counts[w] = counts.get(w, 0) + 1\nreturn counts")
_v("dicts", 4, "key_of_max", "d1", "Return the key of {d1} with the largest value; on a tie, the first such key.",
   "best = None\nfor k in {d1}:\n    if best is None or {d1}[k] > {d1}[best]:\n        best = k\nreturn best")
_v("dicts", 4, "group_by_first_letter", "ws",
   "Return a dictionary that maps each first letter to the list of words in {ws} starting with it, in order.",
   "groups = {{}}\nfor w in {ws}:\n    if w[0] not in groups:\n        groups[w[0]] = []\n    "
   "groups[w[0]].append(w)\nreturn groups")
_v("dicts", 4, "merge_counts", "d e",
   "Return a new dictionary with every key of {d} and {e}, mapped to the sum of its values in both (a missing key "
   "counts as 0).", "result = dict({d})\nfor k, v in {e}.items():\n    result[k] = result.get(k, 0) + v\nreturn result")
_v("dicts", 5, "most_common_word", "ws1",
   "Return the word that occurs most often in {ws1}; on a tie, the one that comes first.",
   "counts = {{}}\nfor w in {ws1}:\n    counts[w] = counts.get(w, 0) + 1\nbest = {ws1}[0]\nfor w in {ws1}:\n    if "
   "counts[w] > counts[best]:\n        best = w\nreturn best")
_v("algorithms", 2, "from_binary", "bits", "Return the number whose binary digits are the string {bits}.",
   "return int({bits}, 2)")
_v("algorithms", 3, "is_sorted", "mxs",
   "Return True if the numbers in {mxs} are in non-decreasing order, otherwise False.",
   "for i in range(1, len({mxs})):\n    if {mxs}[i] < {mxs}[i - 1]:\n        return False\nreturn True")
_v("algorithms", 3, "find_index", "ds t",
   "Return the position of the first occurrence of {t} in {ds}, or -1 if it does not occur.",
   "for i in range(len({ds})):\n    if {ds}[i] == {t}:\n        return i\nreturn -1")
_v("algorithms", 3, "gcd", "p q", "Return the greatest common divisor of {p} and {q}.",
   "while {q} != 0:\n    {p}, {q} = {q}, {p} % {q}\nreturn {p}")
_v("algorithms", 4, "is_prime", "m", "Return True if {m} is a prime number, otherwise False.",
   "if {m} < 2:\n    return False\nfor i in range(2, {m}):\n    if {m} % i == 0:\n        return False\nreturn True")
_v("algorithms", 4, "fibonacci", "n",
   "Return fib({n}), where fib(0) = 0, fib(1) = 1 and fib(i) = fib(i - 1) + fib(i - 2).",
   "a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, a + b\nreturn a")
_v("algorithms", 4, "second_largest", "xs",
   "Return the second largest distinct number in {xs}, or None if there is none.",
   "values = sorted(set({xs}))\nif len(values) < 2:\n    return None\nreturn values[-2]", novel=True)
_v("algorithms", 5, "binary_search", "inc t",
   "{inc} is sorted and has no repeats. Return the position of {t} in it using binary search, or -1 if it is absent.",
   "lo = 0\nhi = len({inc}) - 1\nwhile lo <= hi:\n    mid = (lo + hi) // 2\n    if {inc}[mid] == {t}:\n        "
   "return mid\n    if {inc}[mid] < {t}:\n        lo = mid + 1\n    else:\n        hi = mid - 1\nreturn -1")
_v("algorithms", 5, "two_sum", "ds t",
   "Return [i, j] with i < j for the first pair of positions in {ds} whose numbers add up to {t} (smallest i, then "
   "smallest j), or [] if there is none.",
   "for i in range(len({ds})):\n    for j in range(i + 1, len({ds})):\n        if {ds}[i] + {ds}[j] == {t}:\n        "
   "    return [i, j]\nreturn []")
_v("algorithms", 5, "bubble_sort", "xs", "Sort a copy of {xs} in increasing order with bubble sort and return it.",
   "result = list({xs})\nfor i in range(len(result)):\n    for j in range(len(result) - 1 - i):\n        if "
   "result[j] > result[j + 1]:\n            result[j], result[j + 1] = result[j + 1], result[j]\nreturn result")
_v("algorithms", 5, "primes_below", "m", "Return the list of prime numbers smaller than {m}.",
   "result = []\nfor i in range(2, {m}):\n    if all(i % j != 0 for j in range(2, i)):\n        result.append(i)\n"
   "return result")

# Composition of two or three steps (+ a final reduction). Every single step is seen in training;
# NOVEL_PERCENT of the step combinations are held out whole (slice `novel`): compositional
# generalisation, as in SCAN-style splits (Lake & Baroni 2018).
NOVEL_PERCENT = 20
STR_STEPS = [("upper", "convert it to upper case", "{v}.upper()", {}), ("reverse", "reverse it", "{v}[::-1]", {}),
              ("double", "repeat it twice", "{v} * 2", {}),
              ("suffix_{w}", "append '{w}'", "{v} + '{w}'", {"w": _SUFFIX}),
              ("drop_{ch}", "remove every '{ch}'", "{v}.replace('{ch}', '')", {"ch": list(LETTERS)}),
              ("first_{c}", "keep the first {c} characters", "{v}[:{c}]", {"c": R(1, 5)}),
              ("behead", "drop the first character", "{v}[1:]", {})]
LIST_STEPS = [("sort", "sort it", "sorted({v})", {}), ("reverse", "reverse it", "{v}[::-1]", {}),
               ("add_{c}", "add {c} to every number", "[x + {c} for x in {v}]", {"c": R(1, 9)}),
               ("times_{c}", "multiply every number by {c}", "[x * {c} for x in {v}]", {"c": R(2, 5)}),
               ("above_{c}", "keep only the numbers greater than {c}", "[x for x in {v} if x > {c}]",
                {"c": R(0, 15)}),
               ("evens", "keep only the even numbers", "[x for x in {v} if x % 2 == 0]", {}),
               ("head_{c}", "keep the first {c} numbers", "{v}[:{c}]", {"c": R(1, 5)}),
               ("squares", "square every number", "[x * x for x in {v}]", {})]
_ENDS = [("sum", "the sum"), ("len", "how many numbers are left")]


def percent(key):
    """A stable pseudo-random number in 0..99 for a string key (sha256, not hash(): no per-run salt)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100


def _compose(slot, steps, k, difficulty, ends=(None,)):
    for combo, end in itertools.product(itertools.permutations(steps, k), ends):
        names, docs, body, params = [], [], [], {}
        for i, (short, phrase, expr, ps) in enumerate(combo):
            ren = lambda t: re.sub(r"\{(c|w|ch)\}", lambda m: "{%s%d}" % (m.group(1), i), t)
            names.append(ren(short))
            docs.append(ren(phrase))
            body.append("result = " + ren(expr).replace("{v}", "{%s}" % slot if i == 0 else "result"))
            params.update({f"{p}{i}": ch for p, ch in ps.items()})
        tail = f", then return {end[1]}." if end else ", and return the result."
        body.append(f"return {end[0]}(result)" if end else "return result")
        name = "_then_".join(names) + (f"_{end[0]}" if end else "")
        _v("compose", difficulty, name, slot, f"Take {{{slot}}}, " + ", then ".join(docs) + tail, "\n".join(body),
           novel=percent(f"compose/{slot}/{name}") < NOVEL_PERCENT, **params)


_compose("s", STR_STEPS, 2, 3)
_compose("s", STR_STEPS, 3, 4)
_compose("xs", LIST_STEPS, 2, 3)
_compose("xs", LIST_STEPS, 2, 4, _ENDS)
_compose("xs", LIST_STEPS, 3, 5, _ENDS)


def order_cases(items, r, n_hidden):
    """Shuffle (args, output) cases and put one case per distinct output first, so boolean or
    rare-answer tasks show (and test) both answers and a constant like `return False` cannot pass.
    Returns (the first n_examples + n_hidden cases, n_examples); templates and world.py share it."""
    r.shuffle(items)
    first = {}
    for it in items:
        first.setdefault(repr(it[1]), it)
    ids = {id(it) for it in first.values()}
    ordered = list(first.values()) + [it for it in items if id(it) not in ids]
    n_ex = r.choice((1, 2, 2, 3))
    return ordered[:n_ex + n_hidden], n_ex


def render_doc_prompt(name, arg_names, doc, examples):
    """The prompt: signature, docstring in words and `>>>` examples from (args, output) cases."""
    lines = [f"def {name}({', '.join(arg_names)}):", f'    """{doc}']
    for args, out in examples:
        lines += [f"    >>> {name}({', '.join(map(repr, args))})", f"    {out!r}"]
    return "\n".join(lines + ['    """']) + "\n"
