"""The `hf` backend: transformers' own modeling code, for any architecture it loads.

It is the reference the native backend is tested against, and the path for models the native
backend does not run. A layer subset (self-speculation) runs the decoder stack's own modules
for Llama-style models; batched steps pass the cache's boolean mask. SDPA (what the loader picks)
applies it as is; any other attention implementation (eager, which a model built in memory may
use) adds its mask to the scores, so it gets the same mask as 0 / -inf (`_model_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

from specdec.models.backend import ForwardOutput, kv_bytes_per_token, logits_kept


class HFBackend:
    name = "hf"

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        config = model.config
        self.config = config
        self.model_type = str(getattr(config, "model_type", "?"))
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        param = next(model.parameters())
        self.kv_dtype = param.dtype
        self.device = param.device
        self.weight_format = str(param.dtype).removeprefix("torch.")
        self.kernel_path = "pytorch"
        self.exact_blocks = False  # a prompt's masked attention and MKL's products round by block

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _model_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """A boolean mask (True: attend) as the model's attention implementation applies it."""
        if mask is None or mask.dtype != torch.bool or self.model.config._attn_implementation == "sdpa":
            return mask
        return torch.zeros(mask.shape, dtype=self.kv_dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(self.kv_dtype).min)

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach().float()

    def output_embeddings(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach().float()

    def final_norm_weight(self) -> torch.Tensor:
        return self.model.model.norm.weight.detach().float()

    def kv_bytes_per_token(self, layers: Sequence[int] | None = None) -> int:
        return kv_bytes_per_token(self, layers)

    @torch.inference_mode()
    def forward(
        self,
        cache,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        layers: Sequence[int] | None = None,
        last_only: bool = False,
        hidden: bool = False,
        hidden_layers: Sequence[int] = (),
        last_logits: int | None = None,
    ) -> ForwardOutput:
        new = input_ids.shape[1]
        keep = logits_kept(new, last_only, last_logits)
        mask = self._model_mask(mask)
        if layers is not None:
            return self._forward_layers(cache, input_ids, positions, mask, layers, keep, hidden, hidden_layers)
        states: dict[int, torch.Tensor] = {}
        # A hook reads each asked-for layer's output (transformers' own hidden_states give the
        # last layer's after the final norm).
        hooks = [self.model.model.layers[i].register_forward_hook(
                     lambda module, args, output, i=i: states.__setitem__(i, output[0] if isinstance(output, tuple) else output))
                 for i in hidden_layers]
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=0 if keep == new else keep,
                output_hidden_states=hidden,
            )
        finally:
            for hook in hooks:
                hook.remove()
        normed = None
        if hidden:
            normed = out.hidden_states[-1][:, new - keep :]
        return ForwardOutput(logits=out.logits.float(), hidden=normed, layer_states=states or None)

    def _forward_layers(self, cache, input_ids, positions, mask, layers, keep, hidden, hidden_layers) -> ForwardOutput:
        """The decoder stack over `layers` only; the same modules and arithmetic as the full
        model, so keeping every layer reproduces it."""
        base = self.model.model
        embeds = base.embed_tokens(input_ids)  # [rows, new, hidden]
        if mask is None:
            # The mask's size comes from the first layer run: skipped layers hold nothing.
            mask = create_causal_mask(
                config=base.config, inputs_embeds=embeds, attention_mask=None, cache=cache,
                position_ids=positions, layer_idx=layers[0],
            )
        position_embeddings = base.rotary_emb(embeds, position_ids=positions)
        x = embeds
        states = {}
        for index in layers:
            x = base.layers[index](
                x, attention_mask=mask, position_embeddings=position_embeddings,
                position_ids=positions, cache=cache, use_cache=True,
            )
            if index in hidden_layers:
                states[index] = x
        x = x[:, x.shape[1] - keep :]
        normed = base.norm(x)  # [rows, keep, hidden]
        logits = self.model.lm_head(normed).float()  # [rows, keep, vocab]
        return ForwardOutput(logits=logits, hidden=normed if hidden else None, layer_states=states or None)
