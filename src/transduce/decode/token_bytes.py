"""The bytes each token of a vocabulary writes, for a grammar that reads bytes
(decode/constrained.py): a byte-level BPE's tokens spell bytes as characters (GPT-2's
table), SentencePiece's write "▁" for a space and <0xNN> for a byte they fall back to,
and special tokens (bos, eos, turn markers) write nothing a grammar can read."""

from __future__ import annotations

import json
import re

from transduce.data.tokenizer import TextTokenizer

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_table() -> dict[str, int]:
    """GPT-2's characters for bytes, reversed: printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {chr(b): b for b in printable}, 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


def token_bytes(tokenizer: TextTokenizer, count: int) -> list[bytes | None]:
    """What each of ids 0 .. count - 1 writes (None: a special token, or an id past the
    tokenizer's, which a model's padded output row may have)."""
    if hasattr(tokenizer, "backend"):
        return _hf_bytes(tokenizer, count)
    processor = tokenizer.processor                          # SentencePiece's
    found: list[bytes | None] = []
    for token in range(count):
        if token >= processor.get_piece_size() or processor.is_control(token) \
                or processor.is_unknown(token):
            found.append(None)
        else:
            found.append(_piece_bytes(processor.id_to_piece(token), processor.is_byte(token)))
    return found


def _hf_bytes(tokenizer, count: int) -> list[bytes | None]:
    backend = tokenizer.backend
    specials = {token for token, added in backend.get_added_tokens_decoder().items()
                if added.special}
    byte_level = '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))
    table = byte_level_table() if byte_level else {}
    added = set(backend.get_added_tokens_decoder())
    found: list[bytes | None] = []
    for token in range(count):
        piece = backend.id_to_token(token)
        if piece is None or token in specials:
            found.append(None)
        elif token in added:                          # written as it reads (<tool_call>)
            found.append(piece.encode("utf-8"))
        elif byte_level:
            found.append(bytes(table[char] for char in piece) if all(
                char in table for char in piece) else None)
        else:
            found.append(_piece_bytes(piece, BYTE_PIECE.fullmatch(piece) is not None))
    return found


def _piece_bytes(piece: str, is_byte: bool) -> bytes:
    """A SentencePiece piece's bytes: <0xNN> that byte, else the text with "▁" a space."""
    if is_byte:
        return bytes([int(BYTE_PIECE.fullmatch(piece).group(1), 16)])
    return piece.replace("▁", " ").encode("utf-8")


def special_ids(tokenizer: TextTokenizer) -> dict[str, int]:
    """The special tokens' texts and ids ([TOOL_CALLS] -> 5): a grammar may name one."""
    if hasattr(tokenizer, "backend"):
        return {added.content: token for token, added in
                tokenizer.backend.get_added_tokens_decoder().items() if added.special}
    processor = tokenizer.processor
    return {processor.id_to_piece(token): token for token in range(processor.get_piece_size())
            if processor.is_control(token)}
