"""Shop: a WebShop-like e-commerce environment, entirely in-process, seeded and offline.

The agent reads an instruction ("i need a red cotton shirt, size m, under 40 dollars"), searches a small catalogue
generated for the task, opens an item, chooses its options and buys it. Item ids (a word such as "otter" at levels 0-2,
a code such as "B7K2" above), prices, decoys and the options on offer are drawn per task from the task's
`catalogue_seed`, so held-out tasks test a skill rather than a memorised catalogue. Train and eval tasks are split
by their instruction text (`envs.base.split_of`), so the two splits never share an instruction.

Action grammar (one action per assistant turn; surrounding whitespace is ignored, keywords are case-insensitive):

* `search[<query words>]`, from any page: lists the best-matching items, e.g.
  `results: [B7K2] red cotton shirt $31 | [Q9XA] red cotton shirt $22 | [ZK3P] blue cotton hat $35`.
  A query word scores a point when it is the item's type, material, one of its colours or one of its sizes; other
  words and punctuation are ignored. Items are ranked by points (ties keep the catalogue's random order).
* `click[<item id>]`, on a results page: opens a listed item, e.g. `item B7K2: red cotton shirt $31. sizes: s m l`.
* `choose[<option value>]`, on an item page: selects one of its sizes (at level 4 also one of its colours); a second
  choice of the same kind replaces the first.
* `buy`, on an item page (levels 0, 3 and 4): buys the item with the chosen options and ends the episode.
* `add`, on an item page (levels 1 and 2, the shopping lists): puts the item with the chosen size into the cart as
  the list's next entry; the observation names the list's next item (`added otter to the cart. next: a blue wool
  hat, size s, under 30 dollars`) or says the list is done. A cart entry is final (there is no remove).
* `checkout[<coupon>]`, from any page (levels 1 and 2): pays for the cart with the coupon word and ends the episode.

Anything else, or an action that does not fit the current page or level, returns an `error: ...` observation with
reward 0, done False and the state unchanged. It never raises.

Reward (WebShop-style, on the final turn only; every other turn has reward 0): the fraction of the task's five
attributes matched by the bought item and the chosen options: type, material, colour, size, and price within the
bound. `info["success"]` is `reward == 1.0` (False until then), `info["matched"]` has the per-attribute breakdown and
`info["invalid"]` marks error observations. At levels 1 and 2 the reward is partial credit over the list and the
coupon: `(sum over the n list entries of the fraction of the five attributes the cart's entry matches (0 for an
entry left empty) + [coupon right]) / (n + 1)`; `info["matched"]` is the list of per-entry breakdowns,
`info["coupon"]` whether the coupon was right, `info["bought"]` the cart's ids, and `info["success"]` needs every
entry and the coupon right (reward 1.0).

Difficulty levels:

* 0 (the tiny default model learns it in minutes; positional copying only): 8 items, 3 results. The expert's query is
  the instruction's words; at this level the search engine also drops items above a number in the query ("under 40"),
  so the match is always the first result, and the size to choose is copied from the instruction. Two twins of the
  match punish sloppy queries: one lacks the wanted size (it ties with the match when the query leaves out the size)
  and one costs too much (it ties when the query leaves out the price). Expert: search, click, choose, buy (4 turns).
* 1 (long horizon, a shopping list of 2 items; every step a positional copy, as at level 0): "i need a red cotton
  shirt, size m, under 40 dollars; then a blue wool hat, size s, under 30 dollars; pay with coupon [mango]". 10
  items, 3 results; each list item (of a distinct type) has its match and the two twins of level 0, and the search
  engine filters by price as at level 0, so each item's match is listed first. The query of the first item is copied
  from the instruction, that of each later item from the latest observation (the `add` that names it), the size
  from the query, and the coupon, needed at the last turn, appeared only in the first observation. Expert per item:
  search, click, choose, add; then checkout (9 turns; `max_turns` 16). An expert episode is about 320 tokens of the
  tiny default's tokenizer (63 of them the prompt); `max_completion_length: 640` holds every episode of 16 turns.
* 2 (long horizon, a list of 4 items): as level 1 with 16 items. Expert: 17 turns (`max_turns` 28), about 610 tokens
  (93 the prompt); `max_completion_length: 896` keeps prompt and episode within the tiny default's 1024 positions.
* 3 (content matching, for real models): 12 items, 4 results shown in random order, and the search engine ignores
  prices. Decoys are near misses sharing two of the three title words and twins above the price, so the agent must
  find the one listed item whose title and price fit the instruction. Expert: 4 turns.
* 4 (two options, more results): 16 items, 6 results in random order. Titles name material and type only ("cotton
  shirt"); the item page lists colours and sizes, and both must be chosen. Expert: search, click, choose the size,
  choose the colour, buy (5 turns).

Levels 3 and 4 were levels 1 and 2 before the shopping lists came: their tasks are drawn from the generator seeds
they had then, so every task, catalogue and observation is as before (only `difficulty` and the task id's level
differ).
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
# Coupon words of the shopping lists (levels 1 and 2): a pool apart from the ids and the attributes, written in the
# instruction in brackets as ids are in a listing ("coupon [mango]"), so copying one is the copy `click` makes.
COUPONS = (
    "apple mango lemon peach plum grape melon cherry olive pear lime fig amber coral ivory jade ruby pearl onyx opal"
).split()

N_ITEMS = {0: 8, 1: 10, 2: 16, 3: 12, 4: 16}  # catalogue size per difficulty
N_SHOWN = {0: 3, 1: 3, 2: 3, 3: 4, 4: 6}  # results listed per search
LIST_LENGTH = {1: 2, 2: 4}  # items on the shopping list of the long-horizon levels
MAX_TURNS = {1: 16, 2: 28}  # their turn budgets: 9 and 17 expert turns, with room for recovered mistakes
#: the levels whose search engine drops items above the query's price, so a good query lists the match first
PRICE_FILTER_LEVELS = (0, 1, 2)
#: levels 3 and 4 were levels 1 and 2: their tasks are drawn from the generator seeds they had then
_SEED_LEVEL = {3: 1, 4: 2}

_ACTION = re.compile(r"(search|click|choose)\s*\[([^\[\]]*)\]|(buy)(?:\s*\[\s*\])?", re.IGNORECASE)
_CART_ACTION = re.compile(r"(checkout)\s*\[([^\[\]]*)\]|(add)(?:\s*\[\s*\])?", re.IGNORECASE)  # levels 1 and 2
_WORD = re.compile(r"[a-z0-9]+")


def _item_text(target: dict) -> str:
    t = target
    return f"{t['colour']} {t['material']} {t['type']}, size {t['size']}, under {t['max_price']} dollars"


def _instruction(target: dict) -> str:
    return f"i need a {_item_text(target)}"


def _list_instruction(targets: list[dict], coupon: str) -> str:
    """The shopping list of levels 1 and 2: "i need a <item 1>; then a <item 2>; ...; pay with coupon [<word>]"."""
    return "i need a " + "; then a ".join(_item_text(t) for t in targets) + f"; pay with coupon [{coupon}]"


def _expert_query(target: dict) -> str:
    """The words of the item's line ("red cotton shirt, size m, under 40 dollars") without punctuation: a positional
    copy of the instruction (the first item) or of the latest observation (the next item of a list)."""
    return _item_text(target).replace(",", "")


def _catalogue_rng_helpers(rng: random.Random, level: int, t: dict):
    bound = t["max_price"]

    def sizes(include: bool | None = None) -> list[str]:  # None: include the wanted size at random
        include = rng.random() < 0.5 if include is None else include
        chosen = rng.sample([s for s in SIZES if s != t["size"]], rng.randint(2, 3)) + ([t["size"]] if include else [])
        return sorted(chosen, key=SIZES.index)

    def colours(colour: str) -> list[str]:  # level 4 items offer 2-3 colours, one of them `colour`
        if level != 4:
            return [colour]
        others = rng.sample([c for c in COLOURS if c != colour], rng.randint(1, 2))
        return sorted([colour, *others], key=COLOURS.index)

    def item(type_: str, material: str, colour: str, price: int, sizes_: list[str]) -> dict:
        return {"type": type_, "material": material, "colours": colours(colour), "sizes": sizes_, "price": price}

    def cheap() -> int:
        return rng.randint(max(5, bound - 15), bound - 1)

    def dear() -> int:
        return rng.randint(bound + 1, bound + 25)

    return sizes, item, cheap, dear


def _assign_ids(rng: random.Random, items: list[dict], words: bool) -> None:
    ids: list[str] = []
    while len(ids) < len(items):
        new = rng.choice(ID_WORDS) if words else "".join(rng.choice(ID_CHARS) for _ in range(4))
        if new not in ids:
            ids.append(new)
    for it, id_ in zip(items, ids, strict=True):
        it["id"] = id_


def _build_catalogue(task: dict) -> list[dict]:
    """The task's items, drawn from `catalogue_seed`. Exactly one item fits the whole instruction (the first)."""
    rng = random.Random(task["catalogue_seed"])
    level, t = task["difficulty"], task["target"]
    sizes, item, cheap, dear = _catalogue_rng_helpers(rng, level, t)

    def other(value: str, choices: tuple[str, ...]) -> str:
        return rng.choice([c for c in choices if c != value])

    items = [item(t["type"], t["material"], t["colour"], cheap(), sizes(True))]
    if level == 0:
        items.append(item(t["type"], t["material"], t["colour"], cheap(), sizes(False)))  # lacks the size
        items.append(item(t["type"], t["material"], t["colour"], dear(), sizes(True)))  # too dear
    else:
        for _ in range(rng.randint(1, 2)):  # twins above the price
            items.append(item(t["type"], t["material"], t["colour"], dear(), sizes(True)))
        for _ in range(4 if level == 3 else 5):  # near misses
            type_, material, colour = t["type"], t["material"], t["colour"]
            if level == 3:  # share two of the three title words
                k = rng.randrange(3)
                type_ = other(type_, TYPES) if k == 0 else type_
                material = other(material, MATERIALS) if k == 1 else material
                colour = other(colour, COLOURS) if k == 2 else colour
            elif rng.random() < 0.5:  # level 4: share one of the two title words, maybe the colour
                type_ = other(type_, TYPES)
            else:
                material = other(material, MATERIALS)
            if level == 4 and rng.random() < 0.5:
                colour = other(colour, COLOURS)
            items.append(item(type_, material, colour, rng.randint(8, 99), sizes()))
    while len(items) < N_ITEMS[level]:
        type_, material, colour = rng.choice(TYPES), rng.choice(MATERIALS), rng.choice(COLOURS)
        same_title = (type_, material) == (t["type"], t["material"]) and (level == 4 or colour == t["colour"])
        if not same_title:
            items.append(item(type_, material, colour, rng.randint(8, 99), sizes()))
    _assign_ids(rng, items, words=level == 0)
    return items


def _build_list_catalogue(task: dict) -> list[dict]:
    """The items of a shopping list (levels 1 and 2), drawn from `catalogue_seed`: for each list entry, in order, its
    match and level 0's two twins (one lacking the size, one above the price), then fillers whose title is none of
    the list's. The list's types are distinct, so item k's match is the only item that scores all four query points
    (colour, material, type, size) for its query; it comes first in the returned list's group of three."""
    rng = random.Random(task["catalogue_seed"])
    level, targets = task["difficulty"], task["targets"]
    items = []
    for t in targets:
        sizes, item, cheap, dear = _catalogue_rng_helpers(rng, level, t)
        items.append(item(t["type"], t["material"], t["colour"], cheap(), sizes(True)))  # the match
        items.append(item(t["type"], t["material"], t["colour"], cheap(), sizes(False)))  # lacks the size
        items.append(item(t["type"], t["material"], t["colour"], dear(), sizes(True)))  # too dear
    titles = {(t["type"], t["material"], t["colour"]) for t in targets}
    sizes, item, _, _ = _catalogue_rng_helpers(rng, level, targets[0])
    while len(items) < N_ITEMS[level]:
        type_, material, colour = rng.choice(TYPES), rng.choice(MATERIALS), rng.choice(COLOURS)
        if (type_, material, colour) not in titles:
            items.append(item(type_, material, colour, rng.randint(8, 99), sizes()))
    _assign_ids(rng, items, words=True)
    return items


def listing_title(item: dict, level: int) -> str:
    """The item's title as the listing shows it (its colour left out at level 4)."""
    words = [item["material"], item["type"]] if level == 4 else [item["colours"][0], item["material"], item["type"]]
    return " ".join(words)


def item_attributes(item: dict, size: str | None, colour: str, t: dict) -> dict[str, bool]:
    """Which of the five attributes of target `t` the item with these options matches."""
    return {
        "type": item["type"] == t["type"],
        "material": item["material"] == t["material"],
        "colour": colour == t["colour"],
        "size": size == t["size"],
        "price": item["price"] <= t["max_price"],
    }


class ShopEnv(Env):
    """A seeded WebShop-like shop: search, click an item, choose its options, buy (or, with a shopping list, add each
    item to the cart and check out with the coupon). See the module docstring."""

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
    #: 1: levels 1 and 2 are the shopping lists (the content-matching ones are 3, 4); 2: the noisy checkout types
    #: another coupon, never the last id in the cart
    level_demo_versions = {1: 2, 2: 2}
    #: the shopping lists need a longer warm start than level 0's 300 steps (bench/results/shop_levels/)
    tiny_level_sft_steps = {1: 2000, 2: 2000}
    #: a level-2 list takes 17 expert turns: at noise 0.3 its demonstrations hold about 6.8 mistakes each and the
    #: build started at 0.010 sampled; at 0.1 (1.9 mistakes, level 0's 1.5 at 0.3) it starts at 0.210 sampled, 0.965
    #: greedy (bench/results/level_mix/)
    tiny_level_noise = {2: 0.1}
    #: what differs at the shopping-list levels (1 and 2): an instance at one of them sets these on itself
    #: (`_set_level`, from __init__ and reset), so the class's values, and every text of levels 0, 3 and 4, are
    #: those the shop had before the lists came
    list_level = {
        "action_names": ("search", "click", "choose", "add", "checkout"),
        "state_keys": ("page", "item", "options", "cart"),
        "skill": (
            "The instruction is a shopping list. For each item in turn: search with the words that name it, its size "
            "and its price bound (the first item's in the instruction, each later one's in the observation after "
            "the last add); click the first listed item; choose the size; add it to the cart. When the list is "
            "done, check out with the coupon word the instruction names: checkout[word]."
        ),
    }

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        self.task: dict = {}
        self.catalogue: list[dict] = []  # random order: the search engine's tie-break
        self.target_id = ""  # the match of the target (a list's next entry at levels 1 and 2)
        self.target_ids: list[str] = []  # levels 1 and 2: the match of each list entry, in list order
        self.page = "start"  # "start" | "results" | "item" | "cart" (after an add) | "done"
        self.results: list[dict] = []
        self.item: dict | None = None
        self.chosen: dict[str, str] = {}  # "size" / "colour" -> value
        self.cart: list[tuple[dict, str | None]] = []  # levels 1 and 2: (item, chosen size) per list entry
        self.success = False
        self._set_level()

    def _set_level(self) -> None:
        """The turn budget, actions, state keys and skill text of this instance's level (see `list_level`)."""
        for attr, value in {**self.list_level, "max_turns": MAX_TURNS.get(self.difficulty)}.items():
            if self._is_list():
                setattr(self, attr, value)
            else:
                self.__dict__.pop(attr, None)  # the class's

    def _is_list(self) -> bool:
        return self.difficulty in LIST_LENGTH

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        """`n` tasks of `split` with distinct instructions; a task's split is `split_of(instruction)`."""
        check_split(split)
        if difficulty not in N_ITEMS:
            raise ValueError(f"difficulty must be one of {sorted(N_ITEMS)}, got {difficulty!r}")
        rng = random.Random(f"shop|{seed}|{split}|{_SEED_LEVEL.get(difficulty, difficulty)}")
        tasks: list[dict] = []
        seen: set[str] = set()
        for _ in range(1000 + 100 * n):
            if len(tasks) == n:
                break
            task = {}
            if difficulty in LIST_LENGTH:
                types = rng.sample(TYPES, LIST_LENGTH[difficulty])  # distinct types: one match per query
                targets = [
                    {
                        "type": type_,
                        "material": rng.choice(MATERIALS),
                        "colour": rng.choice(COLOURS),
                        "size": rng.choice(SIZES),
                        "max_price": rng.choice(PRICE_BOUNDS),
                    }
                    for type_ in types
                ]
                coupon = rng.choice(COUPONS)
                instruction = _list_instruction(targets, coupon)
                task = {"targets": targets, "coupon": coupon}
            else:
                target = {
                    "type": rng.choice(TYPES),
                    "material": rng.choice(MATERIALS),
                    "colour": rng.choice(COLOURS),
                    "size": rng.choice(SIZES),
                    "max_price": rng.choice(PRICE_BOUNDS),
                }
                instruction = _instruction(target)
                task = {"target": target}
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
                    **task,
                    "catalogue_seed": catalogue_seed,
                }
            )
        if len(tasks) < n:
            raise ValueError(f"could only make {len(tasks)} distinct {split} shop tasks, asked for {n}")
        return tasks

    def reset(self, task: dict) -> str:
        self.task = task
        self.difficulty = task["difficulty"]
        self._set_level()
        self.page, self.results, self.item, self.chosen, self.success, self.cart = "start", [], None, {}, False, []
        if self._is_list():
            items = _build_list_catalogue(task)
            self.target_ids = [items[3 * k]["id"] for k in range(len(task["targets"]))]
            self.target_id = self.target_ids[0]
            random.Random(task["catalogue_seed"] + 1).shuffle(items)
            self.catalogue = items
            actions = "search[words], click[id], choose[option], add, checkout[coupon]"
            return f"Instruction: {task['instruction']}\nActions: {actions}"
        items = _build_catalogue(task)
        self.target_id = items[0]["id"]
        random.Random(task["catalogue_seed"] + 1).shuffle(items)
        self.catalogue = items
        return f"Instruction: {task['instruction']}\nActions: search[words], click[id], choose[option], buy"

    def privileged(self, task: dict) -> str | None:
        """`Env.privileged`, played at the task's own level (its turn budget), whatever this instance's level."""
        return Env.privileged(ShopEnv(task["difficulty"]), task)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.page == "done":
            return "error: the episode is over", 0.0, True, {"success": self.success, "invalid": True}
        m = _ACTION.fullmatch(action.strip())
        if m is None:
            cart = _CART_ACTION.fullmatch(action.strip()) if self._is_list() else None
            if cart is None:
                return self._error("unknown action")
            return self._checkout(cart.group(2).strip().lower()) if cart.group(1) else self._add()
        verb = (m.group(1) or m.group(3)).lower()
        arg = (m.group(2) or "").strip()
        if verb == "search":
            return self._search(arg)
        if verb == "click":
            return self._click(arg.upper())
        if verb == "choose":
            return self._choose(arg.lower())
        if self._is_list():
            return self._error("buy is not an action here: add the item to the cart, then checkout[coupon]")
        return self._buy()

    def state_key(self) -> str:
        if self.page == "results":
            key = "results:" + ",".join(it["id"] for it in self.results)
        elif self.page == "item" or (self.page == "done" and not self._is_list()):
            chosen = ":".join(f"{k}={self.chosen.get(k, '-')}" for k in self._option_kinds())
            key = f"{self.page}:{self.item['id']}:{chosen}"
        else:
            key = self.page
        if self._is_list():  # what is in the cart decides what the next action means and what the episode is worth
            key += "|cart=" + ",".join(f"{it['id']}:{size or '-'}" for it, size in self.cart)
        return key

    def expert_action(self) -> str:
        if self._is_list():
            if len(self.cart) == len(self.task["targets"]):
                return f"checkout[{self.task['coupon']}]"
            t = self.task["targets"][len(self.cart)]
        else:
            t = self.task["target"]
        if self.page == "item" and self.item["id"] == self.target_id:
            for kind in self._option_kinds():
                if self.chosen.get(kind) != t[kind]:
                    return f"choose[{t[kind]}]"
            return "add" if self._is_list() else "buy"
        if self.page == "results" and any(it["id"] == self.target_id for it in self.results):
            return f"click[{self.target_id}]"
        return f"search[{_expert_query(t)}]"

    def noisy_action(self, rng: random.Random) -> str:
        if self._is_list() and len(self.cart) == len(self.task["targets"]):
            # the list is done: another coupon word. Not a word the episode showed (such as the last id in the
            # cart), which a build learns to copy instead of recalling the coupon (bench/results/level_mix/)
            return f"checkout[{rng.choice([w for w in COUPONS if w != self.task['coupon']])}]"
        t = self.task["targets"][len(self.cart)] if self._is_list() else self.task["target"]
        query = _expert_query(t)
        candidates = [
            "search[" + query.replace(f" size {t['size']}", "") + "]",  # forgets the size
            "search[" + query.split(" size ")[0] + "]",  # forgets the size and the price
        ]
        if self.page == "results":
            candidates += [f"click[{it['id']}]" for it in self.results if it["id"] != self.target_id]
        elif self.page == "item":  # wrong options or buying (adding) early; no wasted searches
            candidates = [f"choose[{s}]" for s in self.item["sizes"] if s != t["size"]]
            if self.difficulty == 4:
                candidates += [f"choose[{c}]" for c in self.item["colours"] if c != t["colour"]]
            candidates.append("add" if self._is_list() else "buy")
        expert = self.expert_action()
        return rng.choice([c for c in candidates if c != expert])

    # --- transitions -------------------------------------------------------------------------------------------------

    def _option_kinds(self) -> tuple[str, ...]:
        return ("size", "colour") if self.difficulty == 4 else ("size",)

    def _error(self, message: str) -> tuple[str, float, bool, dict]:
        return f"error: {message}", 0.0, False, {"success": False, "invalid": True}

    def _ok(self, observation: str) -> tuple[str, float, bool, dict]:
        return observation, 0.0, False, {"success": False, "invalid": False}

    def _search(self, query: str) -> tuple[str, float, bool, dict]:
        words = _WORD.findall(query.lower())
        if not words:
            return self._error("empty search")
        numbers = [int(w) for w in words if w.isdigit()]
        limit = numbers[0] if numbers and self.difficulty in PRICE_FILTER_LEVELS else None
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
        if self.difficulty not in PRICE_FILTER_LEVELS:  # levels 3 and 4: the listing order says nothing
            random.Random(f"{self.task['catalogue_seed']}|{' '.join(sorted(set(words)))}").shuffle(shown)
        self.page, self.results, self.item, self.chosen = "results", shown, None, {}
        listing = " | ".join(f"[{it['id']}] {listing_title(it, self.difficulty)} ${it['price']}" for it in shown)
        return self._ok(f"results: {listing or 'none'}")

    def _click(self, item_id: str) -> tuple[str, float, bool, dict]:
        if self.page != "results":
            return self._error("click needs search results")
        item = next((it for it in self.results if it["id"].upper() == item_id.upper()), None)
        if item is None:
            return self._error("no such item in the results")
        self.page, self.item, self.chosen = "item", item, {}
        options = f"sizes: {' '.join(item['sizes'])}"
        if self.difficulty == 4:
            options = f"colours: {' '.join(item['colours'])}. {options}"
        return self._ok(f"item {item['id']}: {listing_title(item, self.difficulty)} ${item['price']}. {options}")

    def _choose(self, value: str) -> tuple[str, float, bool, dict]:
        if self.page != "item":
            return self._error("open an item first")
        if value in self.item["sizes"]:
            self.chosen["size"] = value
        elif self.difficulty == 4 and value in self.item["colours"]:
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
        colour = self.chosen.get("colour") if self.difficulty == 4 else item["colours"][0]
        matched = item_attributes(item, self.chosen.get("size"), colour, t)
        reward = sum(matched.values()) / len(matched)
        self.page, self.success = "done", reward == 1.0
        info = {"success": self.success, "invalid": False, "matched": matched, "bought": item["id"]}
        return f"bought {item['id']}. score {reward:.2f}", reward, True, info

    def _add(self) -> tuple[str, float, bool, dict]:
        targets = self.task["targets"]
        if len(self.cart) == len(targets):
            return self._error("the list is done: checkout[coupon]")
        if self.page != "item":
            return self._error("open an item first")
        item = self.item
        self.cart.append((item, self.chosen.get("size")))
        self.page, self.results, self.item, self.chosen = "cart", [], None, {}
        if len(self.cart) == len(targets):
            return self._ok(f"added {item['id']} to the cart. the list is done: check out with your coupon")
        self.target_id = self.target_ids[len(self.cart)]
        return self._ok(f"added {item['id']} to the cart. next: a {_item_text(targets[len(self.cart)])}")

    def _checkout(self, coupon: str) -> tuple[str, float, bool, dict]:
        if not coupon:
            return self._error("checkout needs the coupon word")
        targets = self.task["targets"]
        matched = [
            item_attributes(*self.cart[k], self.cart[k][0]["colours"][0], t)
            if k < len(self.cart)
            else dict.fromkeys(("type", "material", "colour", "size", "price"), False)
            for k, t in enumerate(targets)
        ]
        coupon_ok = coupon == self.task["coupon"]
        reward = (sum(sum(m.values()) / len(m) for m in matched) + coupon_ok) / (len(targets) + 1)
        self.page = "done"
        self.success = coupon_ok and all(all(m.values()) for m in matched)
        bought = [it["id"] for it, _ in self.cart]
        info = {"success": self.success, "invalid": False, "matched": matched, "coupon": coupon_ok, "bought": bought}
        return f"checked out {len(bought)} items. score {reward:.2f}", reward, True, info
