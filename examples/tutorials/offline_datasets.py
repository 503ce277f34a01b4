"""Offline stand-ins for the datasets the tutorials download (MNIST, IMDB).

The tutorial scripts in this directory run without a network. Each loader here
returns what the call it replaces returns (same structure, shapes and dtypes),
so a tutorial changes only the line that loads its data:

* `mnist_load_data()` for `keras.datasets.mnist.load_data()`: uint8 images
  of shape (N, 28, 28) in 0..255 and uint8 labels 0..9. The images are the
  8x8 handwritten digits bundled with tfdist (`tfdist.datasets.load_digits`),
  each pixel scaled up to a 3x3 block and padded to 28x28 like MNIST's
  centred digits: real digits, so accuracy means what it means on MNIST.
* `tfds_mnist()` for `tfds.load("mnist", as_supervised=True, with_info=True)`:
  `tf.data` splits of (uint8 image (28, 28, 1), int64 label) and the split sizes.
* `imdb_load_data(num_words)` for `keras.datasets.imdb.load_data(num_words=...)`:
  reviews as lists of word indices (1 = start, 2 = out-of-vocabulary, words
  from 3) of varying length and 0/1 labels. The reviews are generated: random
  filler words plus a few words from a positive or a negative list, so the
  label is learnable from the words, as sentiment is from IMDB's.
"""

from __future__ import annotations

import types

import numpy as np

import tfdist

# IMDB's reserved indices (keras.datasets.imdb.load_data defaults).
START_CHAR, OOV_CHAR, INDEX_FROM = 1, 2, 3


def mnist_load_data(num_test: int = 297) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """MNIST-shaped digits: `((x_train, y_train), (x_test, y_test))`, as `keras.datasets.mnist.load_data()`.

    Args:
        num_test: int. Images kept for the test split (default 297, leaving
            1,500 of the 1,797 bundled digits for training).

    Returns:
        `x_*` uint8 arrays of shape (N, 28, 28) with values 0..255 and `y_*`
        uint8 arrays of labels 0..9, shuffled with a fixed seed.

    Example:

    ```python
    (x_train, y_train), (x_test, y_test) = mnist_load_data()
    ```
    """
    x, y = tfdist.datasets.load_digits(normalize=False, flatten=False)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order, :, :, 0], y[order]
    # Each of the 8x8 pixels becomes a 3x3 block: 24x24, padded by 2 on every side to 28x28.
    big = np.kron(x, np.ones((3, 3), np.float32))
    big = np.pad(big, ((0, 0), (2, 2), (2, 2)))
    images = np.round(big * (255.0 / 16.0)).astype(np.uint8)
    labels = y.astype(np.uint8)
    split = len(images) - num_test
    return (images[:split], labels[:split]), (images[split:], labels[split:])


def tfds_mnist():
    """MNIST as `tfds.load(name="mnist", with_info=True, as_supervised=True)` returns it.

    Returns:
        A tuple `(datasets, info)`: `datasets["train"]` and `datasets["test"]`
        are `tf.data.Dataset`s of `(image, label)` with a uint8 image of shape
        (28, 28, 1) and an int64 label; `info.splits[name].num_examples` is the
        size of each split.

    Example:

    ```python
    datasets, info = tfds_mnist()
    mnist_train, mnist_test = datasets["train"], datasets["test"]
    ```
    """
    import tensorflow as tf

    splits = dict(zip(("train", "test"), mnist_load_data()))
    datasets = {
        name: tf.data.Dataset.from_tensor_slices((x[..., None], y.astype(np.int64)))
        for name, (x, y) in splits.items()
    }
    info = types.SimpleNamespace(
        splits={name: types.SimpleNamespace(num_examples=len(x)) for name, (x, _) in splits.items()}
    )
    return datasets, info


def imdb_load_data(
    num_words: int = 2000,
    num_train: int = 1000,
    num_test: int = 500,
    min_length: int = 20,
    max_length: int = 120,
    seed: int = 0,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """IMDB-shaped reviews: `((x_train, y_train), (x_test, y_test))`, as `keras.datasets.imdb.load_data()`.

    Args:
        num_words: int. Vocabulary size: word indices are below it (default 2000).
        num_train: int. Training reviews (default 1000).
        num_test: int. Test reviews (default 500).
        min_length: int. Shortest review, in words (default 20).
        max_length: int. Longest review, in words (default 120).
        seed: int. Random seed (default 0).

    Returns:
        `x_*` object arrays of Python lists of int word indices, each starting
        with 1, and `y_*` int64 arrays of 0/1 labels, half of each.

    Example:

    ```python
    (x_train, y_train), (x_val, y_val) = imdb_load_data(num_words=2000)
    x_train = keras.utils.pad_sequences(x_train, maxlen=64)
    ```
    """
    rng = np.random.default_rng(seed)
    words = np.arange(INDEX_FROM, num_words)
    # 20 "positive" and 20 "negative" words; every other word is filler.
    sentiment = rng.choice(words, size=40, replace=False)
    positive, negative = sentiment[:20], sentiment[20:]
    filler = np.setdiff1d(words, sentiment)

    def reviews(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.permutation(np.arange(n) % 2).astype(np.int64)
        texts = np.empty(n, dtype=object)
        for i, label in enumerate(labels):
            length = int(rng.integers(min_length, max_length + 1))
            text = rng.choice(filler, size=length)
            # About one word in ten carries the sentiment, anywhere in the review.
            marked = rng.random(length) < 0.1
            marked[rng.integers(length)] = True
            text[marked] = rng.choice(positive if label else negative, size=int(marked.sum()))
            texts[i] = [START_CHAR, *text.tolist()]
        return texts, labels

    return reviews(num_train), reviews(num_test)
