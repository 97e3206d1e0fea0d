"""Train the bundled example models deterministically on CPU (under a minute) and convert them.

    KERAS_BACKEND=torch python models/train_examples.py [--repository models]

* ``forecaster`` (PyTorch): an LSTM with a 1-unit recurrent projection (``proj_size=1``)
  trained to predict the next value of a noisy sine wave. The projection is linear,
  so the model's ``output`` at step t *is* the forecast of step t+1.
* ``wave_classifier`` (Keras 3): two stacked GRUs (24 units, then 3) trained so
  that ``output_last`` is near +1 for the class of the sequence and -1 elsewhere:
  0 = slow sine, 1 = fast sine, 2 = random walk. argmax(output_last) is the class.

Both are converted with ``rnnserve convert`` (which verifies them against their
framework) into the repository, with a config.json for serving.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "torch")
ROOT = Path(__file__).resolve().parents[1]


def sine_batch(rng: np.random.Generator, batch: int, steps: int) -> np.ndarray:
    """Noisy sines with random frequency and phase, [batch, steps + 1]."""
    t = np.arange(steps + 1)
    freq = rng.uniform(0.05, 0.3, (batch, 1))
    phase = rng.uniform(0, 2 * np.pi, (batch, 1))
    return (np.sin(freq * t + phase) + 0.05 * rng.standard_normal((batch, steps + 1))).astype(np.float32)


def train_forecaster(out_dir: Path) -> Path:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    model = torch.nn.LSTM(1, 32, batch_first=True, proj_size=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(300):
        seq = torch.from_numpy(sine_batch(rng, 64, 40))
        pred, _ = model(seq[:, :-1, None])
        loss = torch.nn.functional.mse_loss(pred[:, 5:, 0], seq[:, 6:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"forecaster: final training MSE {loss.item():.4f}")
    path = out_dir / "forecaster.pt"
    torch.save(model.state_dict(), path)
    return path


def wave_batch(rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of 2 features (signal, its step difference), classes 0/1/2, length 30."""
    labels = rng.integers(0, 3, batch)
    t = np.arange(30)
    phase = rng.uniform(0, 2 * np.pi, (batch, 1))
    slow = np.sin(0.15 * t + phase)
    fast = np.sin(0.9 * t + phase)
    walk = np.cumsum(rng.standard_normal((batch, 30)) * 0.3, axis=1)
    signal = np.where(labels[:, None] == 0, slow, np.where(labels[:, None] == 1, fast, walk))
    signal = signal + 0.05 * rng.standard_normal(signal.shape)
    x = np.stack([signal, np.diff(signal, prepend=signal[:, :1])], axis=-1).astype(np.float32)
    return x, labels


def train_classifier(out_dir: Path) -> Path:
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    x, y = wave_batch(rng, 3000)
    target = np.full((len(y), 3), -1.0, np.float32)
    target[np.arange(len(y)), y] = 1.0
    model = keras.Sequential([
        keras.layers.Input((None, 2)),
        keras.layers.GRU(24, return_sequences=True, name="gru_features"),
        keras.layers.GRU(3, name="gru_classes"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, target, epochs=6, batch_size=64, verbose=0, shuffle=False)
    xv, yv = wave_batch(np.random.default_rng(2), 300)
    acc = float(np.mean(np.argmax(model.predict(xv, verbose=0), axis=1) == yv))
    print(f"wave_classifier: validation accuracy {acc:.3f}")
    path = out_dir / "wave_classifier.keras"
    model.save(path)
    return path


CONFIGS = {
    "forecaster": {"max_batch_size": 64},
    "wave_classifier": {"max_batch_size": 64},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, default=ROOT / "models")
    ap.add_argument("--keep-sources", type=Path, help="also keep the trained framework files in this folder")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = args.keep_sources or Path(tmp)
        src.mkdir(parents=True, exist_ok=True)
        for name, path in (("forecaster", train_forecaster(src)), ("wave_classifier", train_classifier(src))):
            subprocess.run([sys.executable, "-m", "service.cli", "convert", str(path), "--name", name,
                            "--repository", str(args.repository), "--overwrite"], check=True, cwd=ROOT)
            config = args.repository / name / "config.json"
            config.write_text(json.dumps(CONFIGS[name], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
