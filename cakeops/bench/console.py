"""Terminal output of the bench tools: a progress bar (tqdm when installed) and messages that do not tear it."""
from typing import Callable, Iterable, List, TypeVar

T = TypeVar("T")


def progress(items: List[T], label: Callable[[T], str]) -> Iterable[T]:
    """Each item, under a tqdm bar labelled by ``label(item)`` (one line per item without tqdm)."""
    try:
        from tqdm import tqdm
    except ImportError:
        for i, item in enumerate(items, 1):
            print(f"[{i}/{len(items)}] {label(item)}", flush=True)
            yield item
        return
    bar = tqdm(items, unit="case")
    for item in bar:
        bar.set_description(label(item))
        yield item


def say(msg: str) -> None:
    """Prints ``msg``: through tqdm when it is drawing a bar, so messages do not tear it."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(msg, flush=True)
    else:
        tqdm.write(msg)
