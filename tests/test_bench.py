"""The benchmark's plot, as the README's first command writes it."""

from PIL import Image

from halstm import bench


def test_plot_is_a_small_palette_png(tmp_path):
    """Plots are committed to docs/, so they are small palette PNGs that keep the repository small:
    64 colours, not matplotlib's RGBA (a third of the bytes)."""
    rows = [bench.Row("LSTM", 100, 16, 256, 1.0, 1e-6, 5.0, 6.0, 50.0),
            bench.Row("GRU", 100, 64, 512, 1.0, 1e-6, 9.0, 8.0, None)]
    bench.plot(rows, tmp_path / "results.png")
    image = Image.open(tmp_path / "results.png")
    assert image.mode == "P" and len(image.getcolors()) <= 64
