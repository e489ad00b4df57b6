"""What the window shows while a model loads or a connection opens: the top bar's progress bar, its
cancel button and the chips' words, from the bridge's load progress (a download in bytes; a GGUF's
first conversion in its stages, the tensors counted; then the weights, tensor by tensor)."""
BUSY_STAGES = {"read": "reading GGUF file…", "tokenizer": "converting GGUF: the tokenizer…",
               "model": "converting GGUF: building the model…"}
COUNTED_STAGES = {"convert": "converting GGUF", "weights": "loading weights"}


def show_loading(win, loading: bool, what: str = "loading model") -> None:
    win.load_bar.setVisible(loading)
    win.cancel_load_button.setVisible(loading and not what.startswith("connecting"))  # nothing loads there
    if loading:
        win.load_bar.setRange(0, 0)
        win.load_bar.setFormat(what)
        win.precision_label.setText(f"{what}...")
        win.model_chip.setText("connecting…" if what.startswith("connecting") else "loading…")


def show_progress(win, done: int, total: int, stage: str = "download") -> None:
    """A busy bar draws no text: the label beside it names the stage."""
    bar, label = win.load_bar, win.precision_label
    if stage in BUSY_STAGES:
        bar.setRange(0, 0)
        label.setText(BUSY_STAGES[stage])
        return
    if total <= 0:
        return
    if stage in COUNTED_STAGES:
        what = COUNTED_STAGES[stage]
        bar.setRange(0, total)
        bar.setValue(done)
        bar.setFormat(f"{what}: tensor {done} of {total}")
        label.setText(f"{what}…")
        return
    bar.setRange(0, 1000)
    bar.setValue(int(1000 * done / total))
    bar.setFormat(f"{done / 1e9:.2f} / {total / 1e9:.2f} GB")
    label.setText("downloading…")
