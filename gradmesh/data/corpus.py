"""Character-level text corpora: the Python standard library's own source, or user text.

The default corpus needs no download: it is built at run time from the `.py` files at the top
of the standard library (found through `sysconfig`), in sorted order, so every worker on a
machine builds the same text and the same vocabulary.
"""

import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from gradmesh.errors import UsageError
from gradmesh.paths import checked


def stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _text_files(path: Path) -> Iterator[Path]:
    """The files of `path` in sorted path order (as sorted(rglob) gives them), hidden ones left out,
    found as they are read: a folder of a million files is not listed whole for its first few."""
    if path.is_file():
        yield path
        return
    found = False
    for file in _walk(path):
        found = True
        yield file
    if not found:
        raise UsageError(
            f"data.path {str(path)!r} is a folder with no files; give a UTF-8 text file or a folder of them"
        )


def _walk(folder: Path) -> Iterator[Path]:
    """Depth first, each folder's entries by name: the order of sorted paths. Links to folders are
    not followed (nor are they by rglob), links to files are."""
    try:
        with os.scandir(folder) as entries:
            listed = sorted(entries, key=lambda e: e.name)
    except PermissionError:
        return  # skipped, as rglob skips it
    for entry in listed:
        if entry.name.startswith("."):
            continue
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path))
        elif entry.is_file():
            yield Path(entry.path)


def load_text(data_path: str, max_chars: int) -> str:
    """The corpus text, at most max_chars characters; bad paths raise UsageError."""
    files: Iterable[Path]
    if data_path:
        path = checked(data_path, "data.path", "a UTF-8 text file or a folder of them", ("file", "folder"))
        files, strict = _text_files(path), True
    else:
        files, strict = stdlib_files(), False
    parts, total = [], 0
    for file in files:
        try:
            with open(file, encoding="utf-8") as handle:
                text = handle.read(max_chars - total)  # a huge file is not read whole for its first characters
        except UnicodeDecodeError:
            if strict:
                raise UsageError(f"data file {str(file)!r} is not UTF-8 text") from None
            continue
        except OSError as exc:
            raise UsageError(f"data file {str(file)!r} cannot be read: {exc.strerror}") from None
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    text = "\n".join(parts)[:max_chars]
    if len(text.strip()) == 0:
        raise UsageError(f"data.path {data_path!r} holds no text; give a non-empty UTF-8 text file")
    return text


@dataclass
class CharVocab:
    chars: str

    def encode(self, text: str) -> torch.Tensor:
        lookup = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([lookup[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    @classmethod
    def of(cls, text: str) -> "CharVocab":
        return cls("".join(sorted(set(text))))


class CharWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of block_size + 1 tokens: (input, next-token target)."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens = tokens
        self.block_size = block_size
        self.length = max(0, (len(tokens) - 1) // block_size)  # no tokens at all: -1 // block_size is -1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        start = index * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]

    def __getitems__(self, indices: list[int]):
        starts = torch.tensor(indices, dtype=torch.long) * self.block_size
        rows = self.tokens[starts[:, None] + torch.arange(self.block_size + 1)]
        return rows[:, :-1], rows[:, 1:]


def char_datasets(text: str, block_size: int, eval_fraction: float):
    """Train and held-out windows and the vocabulary, split at (1 - eval_fraction) of the text."""
    vocab = CharVocab.of(text)
    tokens = vocab.encode(text)
    cut = int(len(tokens) * (1 - eval_fraction))
    train, held_out = CharWindows(tokens[:cut], block_size), CharWindows(tokens[cut:], block_size)
    if len(train) < 1 or len(held_out) < 1:
        raise UsageError(
            f"the text has {len(text)} characters, too few for model.block_size={block_size}; "
            "give more text or a smaller block_size"
        )
    return train, held_out, vocab
