"""What a replica trains: a causal language model on text, or a small CNN on 28x28 images.

A ``Workload`` bundles the model builder, the training loss, each replica's stream of batches, the
held-out batches and the metrics measured on them, so the rest of the node (dilocox/diloco.py's
InnerLoop, daemon/replica_state.py) is the same for both:

* ``TextWorkload``: a Llama preset or file (dilocox/model.py) on a byte-level corpus (dilocox/data.py);
  loss in nats/token, one "sample" per token; pipeline stages supported.
* ``SyntheticWorkload``: ``--workload synthetic:PARAMS:STEP_S`` (dilocox/synthetic.py), an *emulated*
  model of PARAMS values whose inner step sleeps STEP_S seconds: payload sizes and latencies at scale,
  never quality.
* ``ImageWorkload``: ``--model cnn`` on ``--data fashion-mnist`` or ``mnist`` (dilocox/vision.py),
  split among ``num_clients`` clients by ``--partition`` (dilocox/partition.py) with the swarm's seed,
  so every node computes the same split; a node trains client ``shard_key mod num_clients``'s share.
  Loss in nats/image, accuracy measured too; one "sample" per image; whole models only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from dilocox import vision
from dilocox.data import Corpus, ReplicaShard, validation_batches
from dilocox.diloco import InnerLoop
from dilocox.model import ModelSpec, ModelSpecError, causal_lm_loss
from dilocox.partition import local_epochs_to_steps, partition
from dilocox.stages import build_stage
from dilocox.synthetic import SyntheticWorkload
from dilocox.tokenizer import Tokenizer, byte_tokenizer

IMAGE_MODELS = tuple(vision.MODELS)  # cnn, simple-cnn
IMAGE_DATA = ("fashion-mnist", "mnist")


@dataclass
class TextWorkload:
    spec: ModelSpec
    corpus: Corpus
    seq_len: int
    batch_size: int
    eval_batches: int
    kind: str = "text"
    loss_fn: Callable = field(default=causal_lm_loss)
    tokenizer: Tokenizer = field(default_factory=byte_tokenizer)
    data_parts: int = 1  # disjoint contiguous parts of the training stream (ReplicaShard)

    def architecture(self, module: torch.nn.Module) -> dict:
        """What an export needs beside theta (dilocox/export.py): the LlamaConfig fields, the Hugging Face name
        of each of ``module``'s parameters in order, and the tokenizer (name, SHA-256, vocabulary, end-of-text)."""
        return dict(llama=dict(self.spec.llama), names=[module.full_names[n] for n, _ in module.named_parameters()],
                    tokenizer=self.tokenizer.record())

    @property
    def samples_per_step(self) -> int:
        """Tokens per inner step (what tokens_total counts)."""
        return self.batch_size * self.seq_len

    def build(self, seed: int, stage_index: int, num_stages: int) -> torch.nn.Module:
        return build_stage(self.spec, seed, stage_index, num_stages)

    def steps_for_epochs(self, epochs: float) -> int:
        """H for ``epochs`` passes over one of the ``data_parts`` parts of the training stream, at
        batch_size * seq_len tokens per inner step (dilocox.partition.local_epochs_to_steps)."""
        return local_epochs_to_steps(epochs, len(self.corpus.train), self.data_parts, self.samples_per_step)

    def inner_loop(self, module, config, device: str = "cpu", loss_fn=None, seed: int = 0, shard_key: int = 0):
        return InnerLoop(module, config, device=device, loss_fn=loss_fn or self.loss_fn)

    def shard(self, seed: int, shard_key: int) -> ReplicaShard:
        return ReplicaShard(self.corpus.train, self.seq_len, self.batch_size, seed, shard_key, self.data_parts)

    def val_batches(self) -> list:
        return validation_batches(self.corpus, self.seq_len, self.batch_size, self.eval_batches)

    def accuracy(self, model: torch.nn.Module, batches: list) -> float:
        return math.nan  # next-byte accuracy is not reported for language models


@dataclass
class ImageWorkload:
    dataset: vision.ImageDataset
    partition_spec: str
    num_clients: int
    partition_seed: int
    batch_size: int
    eval_batches: int
    kind: str = "image"
    model: str = "cnn"  # a name of vision.MODELS

    def __post_init__(self):
        # the same seed and labels give every node the same split (ValueError names a bad spec)
        self.parts = partition(self.dataset.train_y, self.num_clients, self.partition_spec, self.partition_seed)

    @staticmethod
    def loss_fn(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vision.classification_loss(model, images, labels)[0]

    @property
    def samples_per_step(self) -> int:
        """Images per inner step."""
        return self.batch_size

    def client(self, shard_key: int) -> int:
        return shard_key % self.num_clients

    def steps_for_epochs(self, epochs: float) -> int:
        """H for ``epochs`` passes over a client's mean share (training images / num_clients) at batch_size
        images per inner step (dilocox.partition.local_epochs_to_steps): the same on every node of a swarm."""
        return local_epochs_to_steps(epochs, len(self.dataset.train_y), self.num_clients, self.batch_size)

    def build(self, seed: int, stage_index: int, num_stages: int) -> torch.nn.Module:
        if num_stages != 1:
            raise ModelSpecError(f"the {self.model} model has no pipeline stages: use --stage 0/1")
        return vision.build_image_model(self.model, self.dataset.num_classes, seed)

    def inner_loop(self, module, config, device: str = "cpu", loss_fn=None, seed: int = 0, shard_key: int = 0):
        return InnerLoop(module, config, device=device, loss_fn=loss_fn or self.loss_fn)

    def shard(self, seed: int, shard_key: int) -> vision.ImageShard:
        indices = self.parts[self.client(shard_key)]
        if len(indices) == 0:
            raise ValueError(f"client {self.client(shard_key)} of {self.num_clients} got no images under "
                             f"--partition {self.partition_spec}: pick another data_seed or partition")
        return vision.ImageShard(self.dataset.train_x, self.dataset.train_y, indices, self.batch_size, seed, shard_key)

    def val_batches(self) -> list:
        n = min(len(self.dataset.test_y), self.eval_batches * max(self.batch_size, 256))
        x = torch.from_numpy(np.ascontiguousarray(self.dataset.test_x[:n]))
        y = torch.from_numpy(np.ascontiguousarray(self.dataset.test_y[:n]))
        return list(zip(x.split(256), y.split(256)))

    def accuracy(self, model: torch.nn.Module, batches: list) -> float:
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        return vision.evaluate(model, x, y)[1]


def make_workload(model: str, data: str, seq_len: int | None, batch_size: int | None, eval_batches: int,
                  partition_spec: str = "iid", num_clients: int = 1, seed: int = 0, workload: str | None = None,
                  tokenizer: Tokenizer | None = None, text_field: str = "text", data_parts: int = 1):
    """The workload of a node's configuration (``workload``: an emulated one, which replaces model and data).
    Raises ModelSpecError / DataError / VisionDataError / WorkloadSpecError / ValueError naming the problem
    (a text model on image data, an unknown partition, ...)."""
    if workload:
        return SyntheticWorkload.from_spec(workload)
    if model in IMAGE_MODELS or data in IMAGE_DATA:
        if model not in IMAGE_MODELS or data not in IMAGE_DATA:
            raise ModelSpecError(f"model {model!r} and data {data!r} do not go together: the image models "
                                 f"({', '.join(IMAGE_MODELS)}) train on {' or '.join(IMAGE_DATA)}, the language "
                                 f"models on text")
        return ImageWorkload(vision.load_image_dataset(data), partition_spec, num_clients, seed,
                             batch_size or 64, eval_batches, model=model)
    tok = tokenizer or byte_tokenizer()
    spec = ModelSpec.resolve(model, tok.vocab_size)
    seq_len = seq_len or spec.seq_len
    spec.llama["max_position_embeddings"] = max(seq_len, spec.llama["max_position_embeddings"])
    corpus = Corpus.from_spec(data, seq_len, tokenizer=tok, text_field=text_field)
    return TextWorkload(spec, corpus, seq_len, batch_size or spec.batch_size, eval_batches, tokenizer=tok,
                        data_parts=data_parts)
