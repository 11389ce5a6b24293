"""Any Hugging Face ``AutoModelForSequenceClassification`` reward model (OpenAssistant, Skywork,
ArmoRM families, ...), batched, formatted with the tokenizer's chat template when it has one.
The score is the first logit. Hub ids need network access; local paths work offline."""

from __future__ import annotations

import numpy as np

from .base import RewardModel


class HFReward(RewardModel):
    def __init__(self, path_or_id: str, output_range: tuple[float, float] = (-10.0, 10.0), batch_size: int = 16,
                 max_length: int = 1024, device: str | None = None, name: str | None = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path_or_id)
        self.model = AutoModelForSequenceClassification.from_pretrained(path_or_id)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        self.output_range, self.batch_size, self.max_length = output_range, batch_size, max_length
        self.name = name or str(path_or_id).rstrip("/").split("/")[-1]
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token

    def _text(self, prompt: str, response: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
        return f"{prompt}\n{response}"

    def score(self, prompts, responses):
        import torch

        texts = [self._text(p, r) for p, r in zip(prompts, responses)]
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.max_length).to(self.device)
            with torch.no_grad():
                out.append(self.model(**enc).logits[:, 0].float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0)
