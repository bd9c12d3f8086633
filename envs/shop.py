"""Shop: a WebShop-like e-commerce environment, entirely in-process, seeded and offline.

The agent reads an instruction ("i need a red cotton shirt, size m, under 40 dollars"), searches a small catalogue
generated for the task, opens an item, chooses its options and buys it. Item ids (a word such as "otter" at level 0,
a code such as "B7K2" above), prices, decoys and the options on offer are drawn per task from the task's
`catalogue_seed`, so held-out tasks test a skill rather than a memorised catalogue. Train and eval tasks are split
by their instruction text (`envs.base.split_of`), so the two splits never share an instruction.

Action grammar (one action per assistant turn; surrounding whitespace is ignored, keywords are case-insensitive):

* `search[<query words>]`, from any page: lists the best-matching items, e.g.
  `results: [B7K2] red cotton shirt $31 | [Q9XA] red cotton shirt $22 | [ZK3P] blue cotton hat $35`.
  A query word scores a point when it is the item's type, material, one of its colours or one of its sizes; other
  words and punctuation are ignored. Items are ranked by points (ties keep the catalogue's random order).
* `click[<item id>]`, on a results page: opens a listed item, e.g. `item B7K2: red cotton shirt $31. sizes: s m l`.
* `choose[<option value>]`, on an item page: selects one of its sizes (at level 2 also one of its colours); a second
  choice of the same kind replaces the first.
* `buy`, on an item page: buys the item with the chosen options and ends the episode.

Anything else, or an action that does not fit the current page, returns an `error: ...` observation with reward 0,
done False and the state unchanged. It never raises.

Reward (WebShop-style, on the final turn only; every other turn has reward 0): the fraction of the task's five
attributes matched by the bought item and the chosen options: type, material, colour, size, and price within the
bound. `info["success"]` is `reward == 1.0` (False until then), `info["matched"]` has the per-attribute breakdown and
`info["invalid"]` marks error observations.

Difficulty levels:

* 0 (the tiny default model learns it in minutes; positional copying only): 8 items, 3 results. The expert's query is
  the instruction's words; at this level the search engine also drops items above a number in the query ("under 40"),
  so the match is always the first result, and the size to choose is copied from the instruction. Two twins of the
  match punish sloppy queries: one lacks the wanted size (it ties with the match when the query leaves out the size)
  and one costs too much (it ties when the query leaves out the price). Expert: search, click, choose, buy (4 turns).
* 1 (content matching, for real models): 12 items, 4 results shown in random order, and the search engine ignores
  prices. Decoys are near misses sharing two of the three title words and twins above the price, so the agent must
  find the one listed item whose title and price fit the instruction. Expert: 4 turns.
* 2 (two options, more results): 16 items, 6 results in random order. Titles name material and type only ("cotton
  shirt"); the item page lists colours and sizes, and both must be chosen. Expert: search, click, choose the size,
  choose the colour, buy (5 turns).
"""

from __future__ import annotations

import hashlib
import random
import re

from envs.base import Env, check_split, split_of

TYPES = (
    "shirt",
    "dress",
    "jacket",
    "sweater",
    "skirt",
    "coat",
    "hoodie",
    "scarf",
    "hat",
    "blouse",
    "vest",
    "cardigan",
)
MATERIALS = ("cotton", "wool", "linen", "silk", "denim", "leather", "fleece", "polyester")
COLOURS = ("red", "blue", "green", "black", "white", "grey", "pink", "yellow", "brown", "purple")
SIZES = ("xs", "s", "m", "l", "xl")
PRICE_BOUNDS = (20, 30, 40, 50, 60, 70, 80)
ID_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O or 1/I look-alikes
# Level-0 item ids are single words, so copying one is copying one token (a tiny model learns that in minutes; a
# 4-character code is several tokens and was not learned by the tiny default in 300 SFT steps).
ID_WORDS = (
    "fox owl elk yak emu cod eel ant bee ram ape bat boa doe gnu hog jay koi lynx mole newt orca puma seal swan toad "
    "vole wasp wren crab dove frog goat hare ibis kiwi lark mink moth mule pike quail rook slug tern wolf zebu bison "
    "camel dingo eagle finch gecko heron hyena koala lemur llama moose otter panda raven robin shark sloth squid "
    "stork tapir trout viper whale"
).split()

N_ITEMS = {0: 8, 1: 12, 2: 16}  # catalogue size per difficulty
N_SHOWN = {0: 3, 1: 4, 2: 6}  # results listed per search

_ACTION = re.compile(r"(search|click|choose)\s*\[([^\[\]]*)\]|(buy)(?:\s*\[\s*\])?", re.IGNORECASE)
_WORD = re.compile(r"[a-z0-9]+")


def _instruction(target: dict) -> str:
    t = target
    return f"i need a {t['colour']} {t['material']} {t['type']}, size {t['size']}, under {t['max_price']} dollars"


def _expert_query(target: dict) -> str:
    """The instruction's words after "i need a", without punctuation: a positional copy."""
    return _instruction(target).removeprefix("i need a ").replace(",", "")


def _build_catalogue(task: dict) -> list[dict]:
    """The task's items, drawn from `catalogue_seed`. Exactly one item fits the whole instruction (the first)."""
    rng = random.Random(task["catalogue_seed"])
    level, t = task["difficulty"], task["target"]
    bound = t["max_price"]

    def sizes(include: bool | None = None) -> list[str]:  # None: include the wanted size at random
        include = rng.random() < 0.5 if include is None else include
        chosen = rng.sample([s for s in SIZES if s != t["size"]], rng.randint(2, 3)) + ([t["size"]] if include else [])
        return sorted(chosen, key=SIZES.index)

    def colours(colour: str) -> list[str]:  # level 2 items offer 2-3 colours, one of them `colour`
        if level < 2:
            return [colour]
        others = rng.sample([c for c in COLOURS if c != colour], rng.randint(1, 2))
        return sorted([colour, *others], key=COLOURS.index)

    def item(type_: str, material: str, colour: str, price: int, sizes_: list[str]) -> dict:
        return {"type": type_, "material": material, "colours": colours(colour), "sizes": sizes_, "price": price}

    def other(value: str, choices: tuple[str, ...]) -> str:
        return rng.choice([c for c in choices if c != value])

    def cheap() -> int:
        return rng.randint(max(5, bound - 15), bound - 1)

    def dear() -> int:
        return rng.randint(bound + 1, bound + 25)

    items = [item(t["type"], t["material"], t["colour"], cheap(), sizes(True))]
    if level == 0:
        items.append(item(t["type"], t["material"], t["colour"], cheap(), sizes(False)))  # lacks the size
        items.append(item(t["type"], t["material"], t["colour"], dear(), sizes(True)))  # too dear
    else:
        for _ in range(rng.randint(1, 2)):  # twins above the price
            items.append(item(t["type"], t["material"], t["colour"], dear(), sizes(True)))
        for _ in range(4 if level == 1 else 5):  # near misses
            type_, material, colour = t["type"], t["material"], t["colour"]
            if level == 1:  # share two of the three title words
                k = rng.randrange(3)
                type_ = other(type_, TYPES) if k == 0 else type_
                material = other(material, MATERIALS) if k == 1 else material
                colour = other(colour, COLOURS) if k == 2 else colour
            elif rng.random() < 0.5:  # level 2: share one of the two title words, maybe the colour
                type_ = other(type_, TYPES)
            else:
                material = other(material, MATERIALS)
            if level == 2 and rng.random() < 0.5:
                colour = other(colour, COLOURS)
            items.append(item(type_, material, colour, rng.randint(8, 99), sizes()))
    while len(items) < N_ITEMS[level]:
        type_, material, colour = rng.choice(TYPES), rng.choice(MATERIALS), rng.choice(COLOURS)
        same_title = (type_, material) == (t["type"], t["material"]) and (level == 2 or colour == t["colour"])
        if not same_title:
            items.append(item(type_, material, colour, rng.randint(8, 99), sizes()))

    ids: list[str] = []
    while len(ids) < len(items):
        new = rng.choice(ID_WORDS) if level == 0 else "".join(rng.choice(ID_CHARS) for _ in range(4))
        if new not in ids:
            ids.append(new)
    for it, id_ in zip(items, ids, strict=True):
        it["id"] = id_
    return items


def _title(item: dict, level: int) -> str:
    words = [item["material"], item["type"]] if level == 2 else [item["colours"][0], item["material"], item["type"]]
    return " ".join(words)


class ShopEnv(Env):
    """A seeded WebShop-like shop: search, click an item, choose its options, buy. See the module docstring."""

    name = "shop"
    action_names = ("search", "click", "choose", "buy")
    state_keys = ("page", "item", "options")
    verifier = "attribute_match"
    skill = (
        "Search with the words of the instruction that name the item, its size and its price bound; click the "
        "listed item whose title and price fit the instruction; choose the size (and colour) the instruction names; "
        "then buy."
    )
    max_turns = 8

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        self.task: dict = {}
        self.catalogue: list[dict] = []  # random order: the search engine's tie-break
        self.target_id = ""
        self.page = "start"  # "start" | "results" | "item" | "done"
        self.results: list[dict] = []
        self.item: dict | None = None
        self.chosen: dict[str, str] = {}  # "size" / "colour" -> value
        self.success = False

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        """`n` tasks of `split` with distinct instructions; a task's split is `split_of(instruction)`."""
        check_split(split)
        if difficulty not in N_ITEMS:
            raise ValueError(f"difficulty must be one of {sorted(N_ITEMS)}, got {difficulty!r}")
        rng = random.Random(f"shop|{seed}|{split}|{difficulty}")
        tasks: list[dict] = []
        seen: set[str] = set()
        for _ in range(1000 + 100 * n):
            if len(tasks) == n:
                break
            target = {
                "type": rng.choice(TYPES),
                "material": rng.choice(MATERIALS),
                "colour": rng.choice(COLOURS),
                "size": rng.choice(SIZES),
                "max_price": rng.choice(PRICE_BOUNDS),
            }
            instruction = _instruction(target)
            if instruction in seen or split_of(instruction) != split:
                continue
            seen.add(instruction)
            catalogue_seed = rng.getrandbits(32)
            digest = hashlib.sha256(f"{instruction}|{catalogue_seed}".encode()).hexdigest()[:10]
            tasks.append(
                {
                    "task_id": f"shop-{difficulty}-{digest}",
                    "env": "shop",
                    "difficulty": difficulty,
                    "instruction": instruction,
                    "target": target,
                    "catalogue_seed": catalogue_seed,
                }
            )
        if len(tasks) < n:
            raise ValueError(f"could only make {len(tasks)} distinct {split} shop tasks, asked for {n}")
        return tasks

    def reset(self, task: dict) -> str:
        self.task = task
        self.difficulty = task["difficulty"]
        items = _build_catalogue(task)
        self.target_id = items[0]["id"]
        random.Random(task["catalogue_seed"] + 1).shuffle(items)
        self.catalogue = items
        self.page, self.results, self.item, self.chosen, self.success = "start", [], None, {}, False
        return f"Instruction: {task['instruction']}\nActions: search[words], click[id], choose[option], buy"

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.page == "done":
            return "error: the episode is over", 0.0, True, {"success": self.success, "invalid": True}
        m = _ACTION.fullmatch(action.strip())
        if m is None:
            return self._error("unknown action")
        verb = (m.group(1) or m.group(3)).lower()
        arg = (m.group(2) or "").strip()
        if verb == "search":
            return self._search(arg)
        if verb == "click":
            return self._click(arg.upper())
        if verb == "choose":
            return self._choose(arg.lower())
        return self._buy()

    def state_key(self) -> str:
        if self.page == "results":
            return "results:" + ",".join(it["id"] for it in self.results)
        if self.page in ("item", "done"):
            chosen = ":".join(f"{k}={self.chosen.get(k, '-')}" for k in self._option_kinds())
            return f"{self.page}:{self.item['id']}:{chosen}"
        return self.page

    def expert_action(self) -> str:
        t = self.task["target"]
        if self.page == "item" and self.item["id"] == self.target_id:
            for kind in self._option_kinds():
                if self.chosen.get(kind) != t[kind]:
                    return f"choose[{t[kind]}]"
            return "buy"
        if self.page == "results" and any(it["id"] == self.target_id for it in self.results):
            return f"click[{self.target_id}]"
        return f"search[{_expert_query(self.task['target'])}]"

    def noisy_action(self, rng: random.Random) -> str:
        t = self.task["target"]
        query = _expert_query(t)
        candidates = [
            "search[" + query.replace(f" size {t['size']}", "") + "]",  # forgets the size
            "search[" + query.split(" size ")[0] + "]",  # forgets the size and the price
        ]
        if self.page == "results":
            candidates += [f"click[{it['id']}]" for it in self.results if it["id"] != self.target_id]
        elif self.page == "item":  # wrong options or buying early; no wasted searches
            candidates = [f"choose[{s}]" for s in self.item["sizes"] if s != t["size"]]
            if self.difficulty == 2:
                candidates += [f"choose[{c}]" for c in self.item["colours"] if c != t["colour"]]
            candidates.append("buy")
        expert = self.expert_action()
        return rng.choice([c for c in candidates if c != expert])

    # --- transitions -------------------------------------------------------------------------------------------------

    def _option_kinds(self) -> tuple[str, ...]:
        return ("size", "colour") if self.difficulty == 2 else ("size",)

    def _error(self, message: str) -> tuple[str, float, bool, dict]:
        return f"error: {message}", 0.0, False, {"success": False, "invalid": True}

    def _ok(self, observation: str) -> tuple[str, float, bool, dict]:
        return observation, 0.0, False, {"success": False, "invalid": False}

    def _search(self, query: str) -> tuple[str, float, bool, dict]:
        words = _WORD.findall(query.lower())
        if not words:
            return self._error("empty search")
        numbers = [int(w) for w in words if w.isdigit()]
        limit = numbers[0] if numbers and self.difficulty == 0 else None  # only level 0 filters by price
        scored = []
        for it in self.catalogue:
            if limit is not None and it["price"] > limit:
                continue
            terms = {it["type"], it["material"], *it["colours"], *it["sizes"]}
            score = len(set(words) & terms)
            if score > 0:
                scored.append((score, it))
        scored.sort(key=lambda pair: -pair[0])  # stable: ties keep the catalogue order
        shown = [it for _, it in scored[: N_SHOWN[self.difficulty]]]
        if self.difficulty > 0:  # the listing order says nothing about the match
            random.Random(f"{self.task['catalogue_seed']}|{' '.join(sorted(set(words)))}").shuffle(shown)
        self.page, self.results, self.item, self.chosen = "results", shown, None, {}
        listing = " | ".join(f"[{it['id']}] {_title(it, self.difficulty)} ${it['price']}" for it in shown)
        return self._ok(f"results: {listing or 'none'}")

    def _click(self, item_id: str) -> tuple[str, float, bool, dict]:
        if self.page != "results":
            return self._error("click needs search results")
        item = next((it for it in self.results if it["id"].upper() == item_id.upper()), None)
        if item is None:
            return self._error("no such item in the results")
        self.page, self.item, self.chosen = "item", item, {}
        options = f"sizes: {' '.join(item['sizes'])}"
        if self.difficulty == 2:
            options = f"colours: {' '.join(item['colours'])}. {options}"
        return self._ok(f"item {item['id']}: {_title(item, self.difficulty)} ${item['price']}. {options}")

    def _choose(self, value: str) -> tuple[str, float, bool, dict]:
        if self.page != "item":
            return self._error("open an item first")
        if value in self.item["sizes"]:
            self.chosen["size"] = value
        elif self.difficulty == 2 and value in self.item["colours"]:
            self.chosen["colour"] = value
        else:
            return self._error("no such option")
        return self._ok(
            "selected: " + ", ".join(f"{k} {self.chosen[k]}" for k in self._option_kinds() if k in self.chosen)
        )

    def _buy(self) -> tuple[str, float, bool, dict]:
        if self.page != "item":
            return self._error("open an item first")
        item, t = self.item, self.task["target"]
        colour = self.chosen.get("colour") if self.difficulty == 2 else item["colours"][0]
        matched = {
            "type": item["type"] == t["type"],
            "material": item["material"] == t["material"],
            "colour": colour == t["colour"],
            "size": self.chosen.get("size") == t["size"],
            "price": item["price"] <= t["max_price"],
        }
        reward = sum(matched.values()) / len(matched)
        self.page, self.success = "done", reward == 1.0
        info = {"success": self.success, "invalid": False, "matched": matched, "bought": item["id"]}
        return f"bought {item['id']}. score {reward:.2f}", reward, True, info
