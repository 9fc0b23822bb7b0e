"""How close a generated answer is to the reference answer, for data whose reference turns are text (chats,
instruction pairs, prompt-completion rows), where the tool-call rows say nothing and eval loss is the only other
judge. The usual measures of extractive QA and summarisation, on normalised words: exact match, token F1 (bag of
words, as SQuAD scores) and ROUGE-L F1 (longest common subsequence, so word order counts).

Normalisation: Unicode NFKC, lower case, punctuation and symbols dropped, whitespace split; a word is letters,
digits and the combining marks on them (Devanagari's vowel signs and virama, Thai's vowels: dropped as punctuation,
they split नमस्ते into fragments and scored किताब and कुताब as one word); Chinese and Japanese characters count one
word each (their text has no spaces to split on); an invisible format character within a word (a soft hyphen,
ZWNJ) is dropped, not a split. A text without any word (an emoji, a lone symbol) is scored on its
characters, so an empty reply does not match it in full."""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(rf"[{_CJK}]|[^{_CJK}\s]+")


_ZERO_WIDTH_SPACE = "\u200b"  # the one invisible format character (Cf) that separates words (Thai, Khmer text)


def _word_char(c: str) -> str:
    """`c` as `words` reads it: itself in a word, nothing for an invisible format character inside one (a soft
    hyphen, ZWNJ/ZWJ, a word joiner, a bidi mark: they split "co\u00adoperation" in two, which then matched
    "cooperation" in no word), a space for anything else."""
    cat = unicodedata.category(c)
    if cat[0] in "LNM":
        return c
    return "" if cat == "Cf" and c != _ZERO_WIDTH_SPACE else " "


def words(text: str) -> list[str]:
    """The words of an answer: runs of letters (L), digits (N) and marks (M), other characters
    separating them (invisible format characters other than the zero-width space: none, `_word_char`)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _WORD.findall("".join(map(_word_char, text)))


def tokens(text: str) -> list[str]:
    """What an answer is scored on: its words, or for a text without any (an emoji, a lone symbol: "👍") its
    characters other than spaces. On words alone such a reference was matched in full by an empty reply, or by
    any other symbol ("👎")."""
    return words(text) or [c for c in unicodedata.normalize("NFKC", text).casefold() if not c.isspace()]


def exact_match(predicted: str, reference: str) -> float:
    return float(tokens(predicted) == tokens(reference))


def token_f1(predicted: str, reference: str) -> float:
    """Harmonic mean of the share of predicted words in the reference and of reference words predicted
    (multisets); 1.0 when both are empty."""
    p, r = tokens(predicted), tokens(reference)
    if not p or not r:
        return float(p == r)
    common = sum((Counter(p) & Counter(r)).values())
    return 0.0 if common == 0 else 2 * common / (len(p) + len(r))


def rouge_l(predicted: str, reference: str) -> float:
    """ROUGE-L F1: the longest common subsequence of words against both lengths; 1.0 when both are empty."""
    p, r = tokens(predicted), tokens(reference)
    if not p or not r:
        return float(p == r)
    prev = [0] * (len(r) + 1)  # the LCS table a row at a time
    for a in p:
        cur = [0]
        for j, b in enumerate(r, 1):
            cur.append(prev[j - 1] + 1 if a == b else max(prev[j], cur[j - 1]))
        prev = cur
    lcs = prev[-1]
    return 0.0 if lcs == 0 else 2 * lcs / (len(p) + len(r))


def answer_scores(pairs: list[tuple[str | None, str]]) -> dict[str, float | int | None]:
    """Means over (predicted answer or None for a reply that is not an answer, reference answer) pairs;
    a reply that called a tool or failed to parse scores 0. None for every measure without a pair."""
    n = len(pairs)
    if not n:
        return {"answer_n": 0, "answer_exact_match": None, "answer_f1": None, "answer_rouge_l": None}
    sums = [0.0, 0.0, 0.0]
    for predicted, reference in pairs:
        if predicted is None:
            continue
        sums[0] += exact_match(predicted, reference)
        sums[1] += token_f1(predicted, reference)
        sums[2] += rouge_l(predicted, reference)
    return {"answer_n": n, "answer_exact_match": sums[0] / n, "answer_f1": sums[1] / n, "answer_rouge_l": sums[2] / n}
