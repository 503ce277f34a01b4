"""A zoo of small Keras models, one per model family, with generated data.

Each `ZooModel` builds its model deterministically from a seed, compiles it
with a fresh optimizer, and makes its own data with a seeded NumPy
`RandomState` (the MLP uses the bundled digits): nothing is downloaded, and a
subprocess gets the same model and data from `from tests.models.zoo import ZOO`.

Every model has at least one Dropout layer; parity runs build it with
`dropout=0.0`, so replicas and one device compute the same function, and
`dropout > 0` checks that a model trains with it. BatchNormalization layers
are `synchronized=True`: a replica's share of the batch is then normalised
with the global batch's statistics, as one device does.

Five models train with Adam (among them both embedding models: Keras applies
Adam to a sparse gradient row by row). Four train with SGD with momentum
(mlp, rnn, multi_io, custom_step): Adam's step does not change when every
gradient is scaled alike, so only SGD shows a loss or gradient scaled wrongly
across replicas (a custom `train_step`'s `compute_loss`, `loss_weights`).

Example:

```python
from tests.models.zoo import ZOO

entry = ZOO["transformer"]
x, y = entry.data()
model = entry.make(seed=0, dropout=0.0)      # build + compile
model.fit(x, y, batch_size=entry.batch_size, shuffle=False)
```
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

# Every model trains on the same global batch; 16 splits over 2 replicas and
# over 2 accumulation micro-batches of 8 (4 per replica).
BATCH_SIZE = 16
SAMPLES = 48  # 3 steps of BATCH_SIZE


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One zoo entry: how to build, compile and feed a small model of one family.

    Args:
        name: str. The registry key.
        family: str. The model family, in words.
        build: callable `(seed: int, dropout: float) -> keras.Model`. An
            uncompiled model whose weights depend only on `seed`.
        optimizer: callable `(**kwargs) -> keras.optimizers.Optimizer`. A new
            optimizer per call; kwargs (e.g. `gradient_accumulation_steps=2`)
            go to its constructor.
        compile_kwargs: callable `() -> dict`. `loss`, `metrics`,
            `loss_weights` for `model.compile`.
        data: callable `(samples: int) -> (x, y)`. Deterministic NumPy data;
            `x` and `y` may be dicts keyed by input / output name.
        tolerance: float. Largest max|a-b|/max|a| over weights accepted
            between float32 training under a strategy and on one device.
        why: str. One line: why this tolerance.
        bf16_tolerance: float. The same, for `mixed_bfloat16` training under a
            strategy against one device under the same dtype policy.
        bf16_why: str. One line: why this tolerance.
        batch_size: int. The global batch size. Default `BATCH_SIZE` (16).
    """

    name: str
    family: str
    build: Callable[[int, float], keras.Model]
    optimizer: Callable[..., keras.optimizers.Optimizer]
    compile_kwargs: Callable[[], dict]
    data: Callable[..., tuple]
    tolerance: float
    why: str
    bf16_tolerance: float
    bf16_why: str
    batch_size: int = BATCH_SIZE

    def compile(self, model: keras.Model, **optimizer_kwargs: Any) -> keras.Model:
        """Compiles `model` with a new optimizer; returns it."""
        model.compile(optimizer=self.optimizer(**optimizer_kwargs), **self.compile_kwargs())
        return model

    def make(self, seed: int = 0, dropout: float = 0.0, **optimizer_kwargs: Any) -> keras.Model:
        """Builds and compiles the model (call it inside a strategy's scope)."""
        return self.compile(self.build(seed, dropout), **optimizer_kwargs)


def _seeded(build):
    """Seeds Keras's global RNGs before `build`, so weights depend only on the seed.

    `build` receives `dropout()`, which makes the next Dropout layer at the
    model's rate with its own seed drawn from the model's: a Dropout layer
    left unseeded would draw its seed from the global RNG only when its rate
    is above 0, shifting every initializer after it.
    """

    @functools.wraps(build)
    def wrapper(seed: int = 0, dropout: float = 0.0) -> keras.Model:
        keras.utils.set_random_seed(seed)
        seeds = itertools.count(1000 * seed + 1)
        return build(lambda: keras.layers.Dropout(dropout, seed=next(seeds)))

    return wrapper


def _adam(learning_rate: float = 1e-2):
    return lambda **kwargs: keras.optimizers.Adam(learning_rate, **kwargs)


def _sgd(learning_rate: float = 0.05, momentum: float = 0.9):
    return lambda **kwargs: keras.optimizers.SGD(learning_rate, momentum=momentum, **kwargs)


def _classifier_loss(metrics=("accuracy",)):
    return lambda: {
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": list(metrics),
    }


# --- mlp: the digits MLP -------------------------------------------------------------------------


@_seeded
def _mlp(dropout):
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            dropout(),
            keras.layers.Dense(10),
        ],
        name="mlp",
    )


@functools.cache
def _digits(samples: int = SAMPLES):
    # Imported here: a process without tfdist builds the zoo's models from this module
    # (tests/test_no_interference.py).
    from tfdist.datasets import load_digits

    x, y = load_digits()
    return x[:samples], y[:samples]


# --- convnet: keras-io mnist_convnet with BatchNormalization ----------------------------------------


@_seeded
def _convnet(dropout):
    return keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            # No bias before BatchNorm: it would cancel it, leaving a gradient
            # of rounding noise that Adam scales up to full steps.
            keras.layers.Conv2D(4, 3, use_bias=False),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.Activation("relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            dropout(),
            keras.layers.Dense(4),
        ],
        name="convnet",
    )


def _images(samples, shape, classes, seed):
    """Class-dependent patterns plus noise: each class has its own mean image."""
    rng = np.random.RandomState(seed)
    means = rng.uniform(-1, 1, (classes,) + shape).astype("float32")
    y = rng.randint(0, classes, samples).astype("int32")
    x = means[y] + 0.5 * rng.normal(size=(samples,) + shape).astype("float32")
    return x.astype("float32"), y


@functools.cache
def _convnet_data(samples: int = SAMPLES):
    return _images(samples, (12, 12, 1), 4, seed=1)


# --- transformer: keras-io text_classification_with_transformer --------------------------------------

VOCAB, SEQ, EMBED, HEADS = 50, 12, 16, 2


@keras.saving.register_keras_serializable(package="tfdist_zoo")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned embedding of each position."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.maxlen, self.vocab_size, self.embed_dim = maxlen, vocab_size, embed_dim
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

    def build(self, input_shape):
        self.token_emb.build(input_shape)
        self.pos_emb.build((self.maxlen,))
        super().build(input_shape)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)

    def get_config(self):
        config = super().get_config()
        config.update(maxlen=self.maxlen, vocab_size=self.vocab_size, embed_dim=self.embed_dim)
        return config


@_seeded
def _transformer(dropout):
    inputs = keras.Input((SEQ,), dtype="int32")
    x = TokenAndPositionEmbedding(SEQ, VOCAB, EMBED)(inputs)
    # No attention biases: the key bias shifts every logit of a query equally,
    # so softmax cancels it and its gradient is rounding noise Adam would amplify.
    attention = keras.layers.MultiHeadAttention(HEADS, EMBED // HEADS, use_bias=False)(x, x)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x + dropout()(attention))
    ffn = keras.layers.Dense(16, activation="relu")(x)  # Dense on a 3-D input
    ffn = keras.layers.Dense(EMBED)(ffn)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x + dropout()(ffn))
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = dropout()(x)
    outputs = keras.layers.Dense(2)(x)
    return keras.Model(inputs, outputs, name="transformer")


def _sequences(samples, seed, padded):
    """Token sequences in [1, VOCAB); label 1 when low tokens outnumber high ones.

    With `padded`, each sequence has a random length in [3, SEQ] and is
    zero-padded after it.
    """
    rng = np.random.RandomState(seed)
    x = rng.randint(1, VOCAB, (samples, SEQ)).astype("int32")
    if padded:
        lengths = rng.randint(3, SEQ + 1, samples)
        x[np.arange(SEQ)[None, :] >= lengths[:, None]] = 0
    low = ((x > 0) & (x < VOCAB // 2)).sum(axis=1)
    high = (x >= VOCAB // 2).sum(axis=1)
    return x, (low > high).astype("int32")


@functools.cache
def _transformer_data(samples: int = SAMPLES):
    return _sequences(samples, seed=2, padded=False)


# --- rnn: masked bidirectional GRU text classifier --------------------------------------------------


@_seeded
def _rnn(dropout):
    return keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8, mask_zero=True),
            keras.layers.Bidirectional(keras.layers.GRU(8)),
            dropout(),
            keras.layers.Dense(2),
        ],
        name="rnn",
    )


@functools.cache
def _rnn_data(samples: int = SAMPLES):
    return _sequences(samples, seed=3, padded=True)


# --- multi_io: two inputs, two outputs, loss per output with loss_weights ----------------------------


@_seeded
def _multi_io(dropout):
    a = keras.Input((8,), name="a")
    b = keras.Input((6,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(8, activation="tanh")(a), keras.layers.Dense(8)(b)])
    h = keras.layers.Dense(16, activation="relu")(h)
    h = dropout()(h)
    cls = keras.layers.Dense(3, name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg}, name="multi_io")


def _multi_io_compile():
    return {
        "loss": {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        "loss_weights": {"cls": 1.0, "reg": 0.5},
        "metrics": {"cls": ["accuracy"], "reg": ["mae"]},
    }


@functools.cache
def _multi_io_data(samples: int = SAMPLES):
    rng = np.random.RandomState(4)
    a = rng.normal(size=(samples, 8)).astype("float32")
    b = rng.normal(size=(samples, 6)).astype("float32")
    cls = (np.argmax(a[:, :3] + b[:, :3], axis=1)).astype("int32")
    reg = (a[:, 3:4] - 0.5 * b[:, 3:4]).astype("float32")
    return {"a": a, "b": b}, {"cls": cls, "reg": reg}


# --- custom_step: keras-io "customizing what happens in fit" (TensorFlow backend) -------------------


@keras.saving.register_keras_serializable(package="tfdist_zoo")
class CustomStepModel(keras.Model):
    """A functional model whose `train_step` is written by hand, as in the Keras guide."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


@_seeded
def _custom_step(dropout):
    inputs = keras.Input((10,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h = dropout()(h)
    outputs = keras.layers.Dense(1)(h)
    return CustomStepModel(inputs, outputs, name="custom_step")


@functools.cache
def _regression_data(samples: int = SAMPLES):
    rng = np.random.RandomState(5)
    x = rng.normal(size=(samples, 10)).astype("float32")
    w = rng.normal(size=(10, 1)).astype("float32")
    return x, (np.tanh(x @ w) + 0.1 * rng.normal(size=(samples, 1))).astype("float32")


# --- shared_frozen: one layer shared by two branches, one frozen layer -------------------------------


@_seeded
def _shared_frozen(dropout):
    inputs = keras.Input((10,))
    frozen = keras.layers.Dense(12, name="frozen")
    frozen.trainable = False
    shared = keras.layers.Dense(12, activation="tanh", name="shared")
    left = shared(frozen(inputs))
    right = shared(keras.layers.Dense(12, name="right")(inputs))
    h = keras.layers.Concatenate()([left, right])
    h = dropout()(h)
    outputs = keras.layers.Dense(3)(h)
    return keras.Model(inputs, outputs, name="shared_frozen")


@functools.cache
def _shared_frozen_data(samples: int = SAMPLES):
    rng = np.random.RandomState(6)
    x = rng.normal(size=(samples, 10)).astype("float32")
    return x, np.argmax(x[:, :3] - x[:, 3:6], axis=1).astype("int32")


# --- recommender: user and item embeddings (sparse gradients) ---------------------------------------

USERS, ITEMS = 20, 30


@_seeded
def _recommender(dropout):
    user = keras.Input((1,), dtype="int32", name="user")
    item = keras.Input((1,), dtype="int32", name="item")
    u = keras.layers.Flatten()(keras.layers.Embedding(USERS, 8, name="user_embedding")(user))
    i = keras.layers.Flatten()(keras.layers.Embedding(ITEMS, 8, name="item_embedding")(item))
    dot = keras.layers.Dot(axes=1)([u, i])
    h = keras.layers.Concatenate()([u, i, dot])
    h = keras.layers.Dense(8, activation="relu")(h)
    h = dropout()(h)
    outputs = keras.layers.Dense(1)(h)
    return keras.Model({"user": user, "item": item}, outputs, name="recommender")


@functools.cache
def _recommender_data(samples: int = SAMPLES):
    # Few users and items: every batch repeats rows, so each embedding
    # gradient holds duplicate indices.
    rng = np.random.RandomState(7)
    users = rng.randint(0, USERS, (samples, 1)).astype("int32")
    items = rng.randint(0, ITEMS, (samples, 1)).astype("int32")
    taste = rng.normal(size=(USERS, 3)).astype("float32")
    kind = rng.normal(size=(ITEMS, 3)).astype("float32")
    rating = np.sum(taste[users[:, 0]] * kind[items[:, 0]], axis=1, keepdims=True)
    return {"user": users, "item": items}, rating.astype("float32")


# --- resnet: a residual block with a strided Conv2D, Add and BatchNormalization ----------------------


@_seeded
def _resnet(dropout):
    def conv_bn(x, filters, kernel, strides=1):
        x = keras.layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(x)
        return keras.layers.BatchNormalization(synchronized=True)(x)

    # One downsampling block straight on the input (no stem): each layer more
    # is seconds more tracing in every cell.
    inputs = keras.Input((8, 8, 3))
    shortcut = conv_bn(inputs, 8, 1, strides=2)
    y = keras.layers.Activation("relu")(conv_bn(inputs, 8, 3, strides=2))
    y = conv_bn(y, 8, 3)
    x = keras.layers.Activation("relu")(keras.layers.Add()([shortcut, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = dropout()(x)
    outputs = keras.layers.Dense(4)(x)
    return keras.Model(inputs, outputs, name="resnet")


@functools.cache
def _resnet_data(samples: int = SAMPLES):
    return _images(samples, (8, 8, 3), 4, seed=8)


# --- the registry --------------------------------------------------------------------------------

SUMS = "float32; replicas sum their shares in another order"

ZOO: dict[str, ZooModel] = {
    entry.name: entry
    for entry in [
        ZooModel(
            name="mlp",
            family="MLP on the bundled digits",
            build=_mlp,
            optimizer=_sgd(),
            compile_kwargs=_classifier_loss(),
            data=_digits,
            tolerance=1e-5,
            why=SUMS,
            bf16_tolerance=2e-2,
            bf16_why="bfloat16 (7-bit mantissa) on 8-sample shares vs the 16-sample batch",
        ),
        ZooModel(
            name="convnet",
            family="Conv2D, MaxPooling2D, Flatten, Dropout, Dense, synchronized BatchNorm",
            build=_convnet,
            optimizer=_adam(),
            compile_kwargs=_classifier_loss(),
            data=_convnet_data,
            tolerance=1e-5,
            why="float32; BatchNorm statistics summed from the replicas' shares",
            bf16_tolerance=2e-2,
            bf16_why="bfloat16 on 8-sample shares; Adam steps each weight by about lr whatever its gradient's size",
        ),
        ZooModel(
            name="transformer",
            family="Transformer encoder classifier: token and position Embedding, attention, feed-forward",
            build=_transformer,
            optimizer=_adam(),
            compile_kwargs=_classifier_loss(),
            data=_transformer_data,
            tolerance=1e-5,
            why=SUMS,
            bf16_tolerance=1e-1,
            bf16_why="bfloat16 on 8-sample shares through softmax and 2 LayerNorms; Adam",
        ),
        ZooModel(
            name="rnn",
            family="Embedding(mask_zero=True), Bidirectional GRU, zero-padded sequences",
            build=_rnn,
            optimizer=_sgd(),
            compile_kwargs=_classifier_loss(),
            data=_rnn_data,
            tolerance=1e-5,
            why=SUMS,
            bf16_tolerance=5e-2,
            bf16_why="bfloat16 rounding compounds over 12 recurrent steps each way",
        ),
        ZooModel(
            name="multi_io",
            family="functional, 2 inputs, 2 outputs, a loss per output, loss_weights",
            build=_multi_io,
            optimizer=_sgd(),
            compile_kwargs=_multi_io_compile,
            data=_multi_io_data,
            tolerance=1e-5,
            why=SUMS,
            bf16_tolerance=5e-2,
            bf16_why="squared error of a bfloat16 regression output on 8-sample shares",
        ),
        ZooModel(
            name="custom_step",
            family="subclassed Model overriding train_step (GradientTape, compute_loss, optimizer.apply)",
            build=_custom_step,
            optimizer=_sgd(),
            compile_kwargs=lambda: {"loss": "mse", "metrics": ["mae"]},
            data=_regression_data,
            tolerance=1e-5,
            why="float32; the optimizer sums the replicas' gradients in another order",
            bf16_tolerance=1e-2,
            bf16_why="bfloat16 on 8-sample shares vs the 16-sample batch",
        ),
        ZooModel(
            name="shared_frozen",
            family="a Dense shared by 2 branches and a frozen Dense",
            build=_shared_frozen,
            optimizer=_adam(),
            compile_kwargs=_classifier_loss(),
            data=_shared_frozen_data,
            tolerance=1e-5,
            why=SUMS,
            bf16_tolerance=1e-2,
            bf16_why="bfloat16 on 8-sample shares vs the 16-sample batch",
        ),
        ZooModel(
            name="recommender",
            family="user and item Embedding tables, dot product, Dense (sparse gradients, Adam)",
            build=_recommender,
            optimizer=_adam(),
            compile_kwargs=lambda: {"loss": "mse", "metrics": ["mae"]},
            data=_recommender_data,
            tolerance=1e-5,
            why=SUMS,
            bf16_tolerance=1e-2,
            bf16_why="bfloat16 embedding dot products on 8-sample shares; Adam",
        ),
        ZooModel(
            name="resnet",
            family="residual block: strided Conv2D, Add, synchronized BatchNorm",
            build=_resnet,
            optimizer=_adam(),
            compile_kwargs=_classifier_loss(),
            data=_resnet_data,
            tolerance=1e-5,
            why="float32; BatchNorm statistics summed from the replicas' shares",
            bf16_tolerance=1e-1,
            bf16_why="bfloat16 convolutions feed 3 BatchNorms, whose normalisation scales rounding up; Adam",
        ),
    ]
}

__all__ = ["BATCH_SIZE", "SAMPLES", "ZOO", "ZooModel"]
