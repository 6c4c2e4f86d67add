"""Text ops on string tensors (object arrays of str): StringSplit, StringNormalizer, RegexFullMatch,
and the n-gram counter TfIdfVectorizer (over strings or integers)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo


def string_split(X, delimiter=None, maxsplit=None):
    # No delimiter (or "") splits at runs of whitespace, like str.split(); Y is padded with "".
    parts = [s.split(delimiter or None, -1 if maxsplit is None else maxsplit) for s in X.flat]
    counts = np.array([len(p) for p in parts], dtype=np.int64)
    Y = np.full((len(parts), int(counts.max(initial=0))), "", dtype=object)
    for row, words in zip(Y, parts):
        row[:len(words)] = words
    return Y.reshape(*X.shape, Y.shape[1]), counts.reshape(X.shape)


def string_normalizer(X, case_change_action="NONE", is_case_sensitive=0, locale="",
                      stopwords=None):
    # X is [C] or [1, C]: stop words are dropped (compared ignoring case unless case sensitive),
    # then the case changes. Nothing left gives one "".
    words = list(X.flat)
    if stopwords:
        key = (lambda w: w) if is_case_sensitive else str.lower
        stops = {key(w) for w in stopwords}
        words = [w for w in words if key(w) not in stops]
    if case_change_action == "LOWER":
        words = [w.lower() for w in words]
    elif case_change_action == "UPPER":
        words = [w.upper() for w in words]
    words = words or [""]
    return (np.array(words, dtype=object).reshape(X.shape[:-1] + (len(words),)),)


def check_string_normalizer(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    action = layer.attrs.get("case_change_action", "NONE")
    if action not in ("NONE", "LOWER", "UPPER"):
        return f"case_change_action {action!r} not known (known: NONE, LOWER, UPPER)"
    if layer.attrs.get("locale", "") not in ("", "en_US", "en_US.UTF-8", "C"):
        return f"locale {layer.attrs['locale']!r} not supported (Python's case rules are en_US's)"
    return None


def regex_full_match(X, pattern):
    # The spec names RE2's syntax; Python's re reads RE2 patterns the same way (RE2 is a subset).
    regex = re.compile(pattern)
    return (np.vectorize(lambda s: regex.fullmatch(s) is not None, otypes=[bool])(X),)


def tf_idf_vectorizer(X, mode, min_gram_length, max_gram_length, max_skip_count, ngram_counts,
                      ngram_indexes, pool_int64s=None, pool_strings=None, weights=None):
    pool = list(pool_int64s if pool_int64s is not None else pool_strings)
    coordinate = _ngram_coordinates(pool, ngram_counts, ngram_indexes)
    rows = X.reshape(-1, X.shape[-1]) if X.ndim else X.reshape(1, 1)
    counts = np.zeros((len(rows), max(ngram_indexes) + 1), dtype=np.float32)
    for r, row in enumerate(rows):
        for gram in _ngrams(list(row), min_gram_length, max_gram_length, max_skip_count):
            if gram in coordinate:
                counts[r, coordinate[gram]] += 1
    scale = np.ones(counts.shape[1], np.float32) if weights is None \
        else np.asarray(weights, np.float32)
    if mode == "IDF":
        counts = (counts > 0) * scale
    elif mode == "TFIDF":
        counts = counts * scale
    return (counts.reshape(counts.shape[1:] if X.ndim == 1 else counts.shape).astype(np.float32),)


def _ngram_coordinates(pool, ngram_counts, ngram_indexes) -> dict[tuple, int]:
    """Each n-gram of the pool -> its output coordinate. ngram_counts[k] is where the (k+1)-grams
    start in the pool; the i-th n-gram of the pool (counting on across sizes) is ngram_indexes[i]."""
    grams = []
    bounds = [*ngram_counts, len(pool)]
    for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
        grams += [tuple(pool[i:i + k + 1]) for i in range(start, end, k + 1)]
    return {gram: int(index) for gram, index in zip(grams, ngram_indexes)}


def _ngrams(row, min_n, max_n, max_skip):
    """Every n-gram of the row: n items, `skip` items skipped between neighbours. A unigram is
    counted once, not once per skip."""
    for n in range(min_n, max_n + 1):
        for skip in range(max_skip + 1 if n > 1 else 1):
            span = (n - 1) * (skip + 1)
            for start in range(len(row) - span):
                yield tuple(row[start:start + span + 1:skip + 1])


def check_tf_idf(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode")
    return None if mode in ("TF", "IDF", "TFIDF") else f"TfIdfVectorizer mode {mode!r} not known"


KERNELS: KernelTable = {
    "StringSplit": {20: string_split},
    "StringNormalizer": {10: string_normalizer},
    "RegexFullMatch": {20: regex_full_match},
    "TfIdfVectorizer": {9: tf_idf_vectorizer},
}

CHECKS = {"StringNormalizer": check_string_normalizer, "TfIdfVectorizer": check_tf_idf}
