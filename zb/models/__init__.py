"""The LLaMA family (llama2, llama3) with its size table; no knowledge of distribution.

    args = model_args(cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=cfg.data.seq_length)
    model = Transformer(args); model.init_weights(cfg.train.seed)
    loss, z = model(inputs, labels=labels, loss=zb.models.loss.LossSpec(z_loss_weight))  # or model(inputs): logits
"""

from zb.models import loss
from zb.models.args import MODEL_SIZES, ModelArgs, flash_available, model_args, model_names
from zb.models.llama import Transformer, TransformerBlock, count_params

__all__ = ["MODEL_SIZES", "ModelArgs", "Transformer", "TransformerBlock", "count_params", "flash_available",
           "loss", "model_args", "model_names"]
