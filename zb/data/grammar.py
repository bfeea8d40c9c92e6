"""The built-in data: a seeded probabilistic grammar of English-like text, with a known entropy.

A document is a topic heading and 1-8 sentences ("# garden\nThe small dog sees a red flower near
the tree. Anna sleeps quietly."). Sentences have subject/verb number agreement, optional adjectives,
adverbs and prepositional phrases; nouns come mostly from the document's topic, so there are
dependencies across sentences for a model to learn. Word choices are Zipf-distributed.

Why it has a computable entropy floor: every word list is disjoint (also after pluralisation and
capitalisation), so the text determines every random choice that made it. The information in a
document is then exactly the sum of -log p over its choices, which the generator tracks; the
entropy rate of the packed token stream is E[-log p(doc)] / E[tokens per doc incl. EOS]. No model
can beat it on average; a finite-context model starting mid-document sits somewhat above it.

Document i of seed s is a pure function of (s, i): infinite, deterministic, order-independent.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from typing import Any

from zb.data.hashing import mix64

TOPICS = {
    "farm": "dog cat horse goat cow pig duck hen sheep farmer barn field fence tractor",
    "kitchen": "cup plate spoon bowl bread apple cake knife pan cook table egg lemon kettle",
    "city": "car street shop train bridge tower park market road driver lamp window door station",
    "sea": "boat wave ship fish whale shell sailor island rock harbor anchor net gull storm",
    "forest": "tree bear wolf deer owl leaf river path stone mushroom hunter cabin trail fox",
    "school": "book pen teacher student desk lesson page letter map clock bell chair painting poem",
}
COMMON = "friend thing song gift box photo idea story game ball hat coat"
NAMES = "Anna Tom Maria Ben Lena Omar Yuki Ravi Clara Felix"
ADJECTIVES = "small big old young red green quiet happy bright dark warm cold tall little strange"
TRANSITIVE = "see find like take make help want hold keep paint build visit follow call carry watch"
INTRANSITIVE = "sleep run sing wait smile jump walk rest laugh swim work dream"
ADVERBS = "quietly slowly again today often happily early later together outside"
PREPOSITIONS = "near under behind beside above inside without across"
DET_SINGULAR, DET_PLURAL = "the a this", "the some these many"
ES_ENDINGS = ("ch", "sh", "s", "x")


def _third_person(verb: str) -> str:
    return verb + ("es" if verb.endswith(ES_ENDINGS) else "s")


@dataclass(frozen=True)
class Choice:
    """A Zipf-weighted list: sample in O(log n), with the log-probability of each option."""

    words: tuple[Any, ...]   # words, or other values to pick (sentence counts, coin sides)
    cum: tuple[float, ...]
    logp: tuple[float, ...]

    @classmethod
    def zipf(cls, words: list[str] | str, exponent: float = 1.0) -> Choice:
        options = tuple(words.split() if isinstance(words, str) else words)
        weights = [1.0 / (rank + 1) ** exponent for rank in range(len(options))]
        return cls.weighted(options, weights)

    @classmethod
    def weighted(cls, words, weights) -> Choice:
        total = sum(weights)
        cum, acc = [], 0.0
        for w in weights:
            acc += w / total
            cum.append(acc)
        cum[-1] = 1.0
        return cls(tuple(words), tuple(cum), tuple(math.log(w / total) for w in weights))

    def pick(self, rng: random.Random) -> tuple[int, float]:
        i = bisect.bisect_right(self.cum, rng.random())
        i = min(i, len(self.words) - 1)
        return i, self.logp[i]


class Grammar:
    """The fixed grammar; `document(seed, index)` returns (text, -log p of the document in nats)."""

    def __init__(self) -> None:
        self.topic = Choice.zipf(list(TOPICS), 0.0)
        self.topic_nouns = {t: Choice.zipf(nouns) for t, nouns in TOPICS.items()}
        self.common = Choice.zipf(COMMON)
        self.names, self.adjectives = Choice.zipf(NAMES), Choice.zipf(ADJECTIVES)
        self.transitive, self.intransitive = Choice.zipf(TRANSITIVE), Choice.zipf(INTRANSITIVE)
        self.adverbs, self.prepositions = Choice.zipf(ADVERBS), Choice.zipf(PREPOSITIONS)
        self.det = {False: Choice.zipf(DET_SINGULAR), True: Choice.zipf(DET_PLURAL)}
        self.sentences = Choice.weighted(range(1, 9), [1, 2, 3, 3, 3, 2, 1, 1])
        self.coin = {p: Choice.weighted((True, False), (p, 1 - p)) for p in (0.15, 0.25, 0.3, 0.35, 0.5, 0.8)}
        self._check_unambiguous()

    def _check_unambiguous(self) -> None:
        """Every surface word must come from exactly one choice, or the entropy would be overstated."""
        nouns = " ".join(TOPICS.values()) + " " + COMMON
        forms = [n for noun in nouns.split() for n in (noun, noun + "s")]
        verbs = (TRANSITIVE + " " + INTRANSITIVE).split()
        forms += [f for v in verbs for f in (v, _third_person(v))]
        forms += (ADJECTIVES + " " + ADVERBS + " " + PREPOSITIONS + " " + NAMES).split() + list(TOPICS)
        forms += sorted(set((DET_SINGULAR + " " + DET_PLURAL).split()))
        assert len(forms) == len(set(forms)), "built-in grammar word lists overlap"

    def document(self, seed: int, index: int) -> tuple[str, float]:
        rng = random.Random(mix64(seed, index))
        t, info = self.topic.pick(rng)
        topic = self.topic.words[t]
        n, lp = self.sentences.pick(rng)
        info += lp
        parts = [f"# {topic}\n"]
        for _ in range(self.sentences.words[n]):
            words, lp = self._sentence(rng, topic)
            info += lp
            sentence = " ".join(words)
            parts.append(sentence[0].upper() + sentence[1:] + ".")
        return parts[0] + " ".join(parts[1:]), -info

    def _flip(self, rng: random.Random, p: float) -> tuple[bool, float]:
        i, lp = self.coin[p].pick(rng)
        return i == 0, lp

    def _maybe_word(self, rng: random.Random, p: float, choice) -> tuple[list[str], float]:
        """With probability p one word of `choice`, else none; and the log p of what was drawn."""
        present, info = self._flip(rng, p)
        if not present:
            return [], info
        i, lp = choice.pick(rng)
        return [choice.words[i]], info + lp

    def _noun_phrase(self, rng: random.Random, topic: str) -> tuple[list[str], bool, float]:
        """(words, plural, log p): a name, or determiner [adjective] noun."""
        is_name, info = self._flip(rng, 0.15)
        if is_name:
            i, lp = self.names.pick(rng)
            return [self.names.words[i]], False, info + lp
        plural, lp = self._flip(rng, 0.3)
        info += lp
        d, lp = self.det[plural].pick(rng)
        words, info = [self.det[plural].words[d]], info + lp
        adjective, lp = self._maybe_word(rng, 0.35, self.adjectives)
        words, info = words + adjective, info + lp
        from_topic, lp = self._flip(rng, 0.8)
        source = self.topic_nouns[topic] if from_topic else self.common
        k, lp2 = source.pick(rng)
        return words + [source.words[k] + ("s" if plural else "")], plural, info + lp + lp2

    def _sentence(self, rng: random.Random, topic: str) -> tuple[list[str], float]:
        words, plural, info = self._noun_phrase(rng, topic)
        transitive, lp = self._flip(rng, 0.5)
        info += lp
        verbs = self.transitive if transitive else self.intransitive
        v, lp = verbs.pick(rng)
        words.append(verbs.words[v] if plural else _third_person(verbs.words[v]))
        info += lp
        if transitive:
            obj, _, lp = self._noun_phrase(rng, topic)
            words, info = words + obj, info + lp
        else:
            adverb, lp = self._maybe_word(rng, 0.5, self.adverbs)
            words, info = words + adverb, info + lp
        has_pp, lp = self._flip(rng, 0.25)
        info += lp
        if has_pp:
            p, lp = self.prepositions.pick(rng)
            obj, _, lp2 = self._noun_phrase(rng, topic)
            words, info = words + [self.prepositions.words[p]] + obj, info + lp + lp2
        return words, info


GRAMMAR = Grammar()
