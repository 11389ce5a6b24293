"""Any Hugging Face ``AutoModelForSequenceClassification`` reward model with one output logit
(OpenAssistant, Skywork, ArmoRM families, ...), read correctly whatever its tokenizer does.

The score of (prompt, response) is the head's logit at the text's last real token:

- **Tokenized once.** With a chat template, the conversation [user: prompt, assistant: response] is
  rendered by the template and tokenized with ``add_special_tokens=False``: the template's own BOS is
  the only one (rendering to text and tokenizing it again gives ``[bos, bos, ...]`` on Llama-3-style
  templates). Without a template, the tokenizer's text-pair encoding ``tokenizer(prompt, response)``,
  with its special tokens, as encoder reward models (OpenAssistant's DeBERTa) are documented.
- **The last real token.** Batches are padded on the right by privalign, whatever the tokenizer's
  ``padding_side``, with an attention mask. For decoder classifiers (a ``score`` head applied at every
  position: Llama, Qwen, Mistral, Gemma, GPT-2, ...) the head's output is read at position
  ``sum(mask) - 1`` of each row, so neither ``pad == eos`` nor an eos inside the text moves it (the
  models' own pooling looks for the pad id). Encoder classifiers pool their first token themselves.
- **Custom code** (ArmoRM) runs only with ``trust_remote_code=True``; its output's ``score`` is used
  when it has one, else its single logit.
- **Batched by length**, ``batch_size`` rows at a time (default: 16 on the CPU, from free memory on
  CUDA), in ``dtype`` (``privalign.devices``: auto = the checkpoint's dtype on a GPU, float32 on the
  CPU); scores come back as float64 on the host. A text longer than ``max_length`` tokens is an error
  naming it, never a silently truncated score.

Hub ids need network access; local paths work offline.
"""

from __future__ import annotations

import numpy as np

from .base import RewardModel

CPU_BATCH = 16


def _config_dict(path_or_id: str) -> dict:
    """The checkpoint's config.json as a dict, read without running any of its code."""
    from transformers import PretrainedConfig

    return PretrainedConfig.get_config_dict(path_or_id)[0]


class HFReward(RewardModel):
    def __init__(self, path_or_id: str, output_range: tuple[float, float] = (-10.0, 10.0),
                 batch_size: int | None = None, max_length: int | None = None, device: str | None = None,
                 dtype: str | None = None, trust_remote_code: bool = False, name: str | None = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from ..devices import checkpoint_dtype, resolve_device, resolve_dtype

        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.device = resolve_device(device)
        resolve_dtype(dtype, self.device)  # an unknown or unrunnable dtype is refused before loading
        config = _config_dict(path_or_id)
        if config.get("auto_map") and not trust_remote_code:
            raise ValueError(f"reward model {path_or_id!r} runs custom code ({', '.join(config['auto_map'])}): "
                             "load it with trust_remote_code=True (--trust-remote-code, or [reward] "
                             "trust_remote_code = true) only if you trust that code")
        labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)
        if not trust_remote_code and labels != 1:
            raise ValueError(f"reward model {path_or_id!r} has {labels} output logits (num_labels={labels}): "
                             "privalign reads one score, so it needs a single-logit reward head")
        self.tokenizer = AutoTokenizer.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
        from transformers import AutoConfig

        self.dtype = resolve_dtype(dtype, self.device, checkpoint_dtype(
            AutoConfig.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)))
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path_or_id, dtype=self.dtype, trust_remote_code=trust_remote_code)
        self.model.to(self.device).eval()
        self.custom = trust_remote_code and bool(config.get("auto_map"))
        head = getattr(self.model, "score", None)
        self._head = head if isinstance(head, torch.nn.Module) and not self.custom else None
        import inspect

        accepts = inspect.signature(self.model.forward).parameters
        self._extra = {"use_cache": False} if "use_cache" in accepts else {}  # no KV cache for one pass
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        if getattr(self.model.config, "pad_token_id", None) is None:
            self.model.config.pad_token_id = self.pad_id  # the models' own pooling needs one to run batched
        limit = getattr(self.model.config, "max_position_embeddings", None) or 512
        self.max_length = int(max_length or limit)
        self.output_range, self.batch_size = output_range, batch_size
        self.name = name or str(path_or_id).rstrip("/").split("/")[-1]

    # ---------------------------------------------------------------- tokenization
    def encode(self, prompt: str, response: str) -> list[int]:
        """The token ids the model reads for (prompt, response), special tokens included once."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt, response)["input_ids"])

    # ---------------------------------------------------------------- scoring
    def _rows(self, n: int, longest: int) -> int:
        if self.batch_size is not None:
            return self.batch_size
        import torch

        if self.device.split(":")[0] != "cuda" or not torch.cuda.is_available():
            return CPU_BATCH
        cfg = self.model.config
        width = next(self.model.parameters()).element_size()
        per_row = 16 * longest * cfg.hidden_size * width + 4 * longest * longest * getattr(cfg, "num_attention_heads", 1)
        free, _ = torch.cuda.mem_get_info(torch.device(self.device))
        return max(1, min(n, 1024, int(free * 0.3 // per_row)))

    def _forward(self, ids: list[list[int]]):
        """Scores of one batch of token-id rows, padded on the right."""
        import torch

        width = max(len(r) for r in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, r in enumerate(ids):
            input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        captured = {}
        hook = (self._head.register_forward_hook(lambda mod, args, out: captured.setdefault("logits", out))
                if self._head is not None else None)
        try:
            with torch.no_grad():
                out = self.model(input_ids=input_ids, attention_mask=mask, **self._extra)
        finally:
            if hook is not None:
                hook.remove()
        if "logits" in captured:  # [rows, positions, 1]: the head at every position, read at the last real one
            per_position = captured["logits"]
            logits = per_position[torch.arange(len(ids), device=per_position.device), mask.sum(1) - 1]
        elif self.custom and getattr(out, "score", None) is not None:
            logits = out.score.reshape(len(ids), -1)
        else:
            logits = out.logits
        if logits.shape[-1] != 1:
            raise ValueError(f"reward model {self.name!r} returned {logits.shape[-1]} logits per text: privalign "
                             "needs a single-logit reward head")
        return logits[:, 0].float().cpu().numpy().astype(np.float64)

    def score(self, prompts, responses):
        from ..devices import out_of_memory

        ids = [self.encode(p, r) for p, r in zip(prompts, responses)]
        for i, r in enumerate(ids):
            if len(r) > self.max_length:
                raise ValueError(f"text {i} is {len(r)} tokens, over the reward model's max_length="
                                 f"{self.max_length}: shorten the response or raise max_length")
        out = np.zeros(len(ids))
        order = np.argsort([-len(r) for r in ids], kind="stable")  # by length: little padding per batch
        i = 0
        while i < len(order):
            size = self._rows(len(order) - i, len(ids[order[i]]))
            chunk = order[i:i + size]
            with out_of_memory(size):
                out[chunk] = self._forward([ids[j] for j in chunk])
            i += size
        return out

