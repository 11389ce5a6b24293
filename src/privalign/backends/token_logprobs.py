"""Per-token log-probabilities of an answer under the policy (OpenAI's ``logprobs``), each token
with its own bytes and OpenAI's spelling of them."""

from __future__ import annotations

from ..devices import out_of_memory


def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character map (GPT-2's ``bytes_to_unicode``)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTES = _byte_decoder()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes: byte-level BPE pieces mapped back to bytes, SentencePiece byte-fallback
    tokens (``<0xNN>``) read as their byte, anything else its decoded text's UTF-8."""
    import re

    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str):
        if all(c in _BYTES for c in piece):
            return bytes(_BYTES[c] for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
    return tokenizer.decode([int(token_id)]).encode("utf-8")


def token_text(raw: bytes) -> str:
    """A token's text: its bytes decoded, or OpenAI's ``bytes:\\xf0\\x9f`` spelling where they are part
    of a character that the next tokens complete."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def token_logprobs(model, tokenizer, device, ids, text: str, *, top: int = 0,
                   temperature: float = 1.0) -> list[dict]:
    """The log-probability of each token of ``text`` as the answer to the prompt ``ids`` (1-D) under the
    policy at ``temperature`` (the law its candidates are sampled from), by one teacher-forced
    pass: ``[{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] * top}]``.
    ``text`` is encoded as the tokenizer encodes it (which may split it differently from the
    sampled tokens). ``bytes`` are the token's own UTF-8 bytes (a character split across tokens
    has part of its bytes in each), and ``token`` is their text, or OpenAI's ``bytes:\\xNN...``
    spelling where they are not valid UTF-8 alone (``token_text``). The policy does not read the
    private data, so this is post-processing."""
    import torch

    toks = tokenizer.encode(text, add_special_tokens=False)
    if not toks:
        return []
    full = torch.cat([ids, torch.tensor(toks, dtype=ids.dtype, device=device)])[None]
    with torch.no_grad(), out_of_memory(1):
        logits = model(full).logits[0, ids.numel() - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    chosen = logp.gather(1, torch.tensor(toks, device=device)[:, None])[:, 0].double().cpu().tolist()
    alt = logp.topk(top, dim=-1) if top else None
    alt_v = alt.values.double().cpu().tolist() if top else None
    alt_i = alt.indices.cpu().tolist() if top else None

    def entry(i, lp):
        raw = token_bytes(tokenizer, i)
        return {"token": token_text(raw), "logprob": lp, "bytes": list(raw)}

    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in zip(alt_i[j], alt_v[j])] if top else []}
            for j, (t, lp) in enumerate(zip(toks, chosen))]
