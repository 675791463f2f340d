"""The MLflow model logged for a checkpoint (MLflow "models from code"; ``flows/tracking.py``
logs this file with the checkpoint's HF policy folder as the artifact ``hf_model``).

Load it with ``mlflow.pyfunc.load_model("models:/NAME/VERSION")`` and call
``predict(["What is 7 + 5?", ...], params={"max_new_tokens": 64})``: greedy completions, one
string per prompt (chat template applied when the tokenizer has one). The HF folder itself is
``<model>/artifacts/hf_model``: ``AutoModelForCausalLM.from_pretrained`` and vLLM read it as it is.
(mlflow.transformers cannot save a local checkpoint with the pinned transformers release:
``build_flavor_config_from_local_checkpoint`` fails on its pipeline registry.)
"""

from __future__ import annotations

from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel


class HFTextGeneration(PythonModel):
    def load_context(self, context: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["hf_model"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path)
        self.model.eval()

    def predict(self, context, model_input, params=None):  # noqa: ANN001, ANN201 - MLflow reads type hints as a schema
        import torch

        prompts = list(model_input["prompt"]) if hasattr(model_input, "columns") else list(model_input)
        max_new = int((params or {}).get("max_new_tokens", 64))
        out = []
        for prompt in prompts:
            text = str(prompt)
            if self.tokenizer.chat_template:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                          add_generation_prompt=True)
            ids = self.tokenizer(text, return_tensors="pt")
            with torch.no_grad():
                gen = self.model.generate(**ids, max_new_tokens=max_new, do_sample=False)
            out.append(self.tokenizer.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
        return out


mlflow.models.set_model(HFTextGeneration())
