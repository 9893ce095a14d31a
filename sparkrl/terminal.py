"""What `sparkrl up` shows on the terminal: the header, one progress line (rewritten in place on a
terminal, printed once per change elsewhere), and messages that never land in the middle of it."""

from __future__ import annotations

import re
import sys
import time

from sparkrl.plan import StackPlan
from sparkrl.services.common.bus._text import mask_password


def header(plan: StackPlan, preset_name: str | None, workers: int) -> str:
    s = plan.settings
    redis_url = mask_password(s.bus.url) + (" (private)" if plan.private_redis else "")
    return (
        f"sparkrl up: preset {preset_name or '(defaults)'}, run dir {plan.run_dir}, "
        f"{workers} worker{'s' if workers != 1 else ''}\n"
        f"  redis {redis_url} | reward {s.reward.url}"
        f" | weight sync {s.sync.host}:{s.sync.port} | logs {plan.run_dir / 'logs'}/\n"
        f"  live page {plan.page_url} | token {plan.token_path} | `sparkrl status --run-dir {plan.run_dir}`"
    )


_ELAPSED = re.compile(r"^starting \d+s")  # the start-up line's clock, which changes every second
OFF_TERMINAL_EVERY_S = 30.0  # off a terminal, a start-up line that says nothing new is printed this often


class Terminal:
    """The progress line and the messages around it."""

    def __init__(self) -> None:
        self.last_line: str | None = None
        self.line_open = False
        self.last_printed: tuple[str, float] | None = None  # off a terminal: what was said, and when

    def _news(self, line: str) -> bool:
        """Off a terminal (a log, CI), whether `line` says something new: the start-up line's seconds
        alone are not, except every OFF_TERMINAL_EVERY_S (a long compile still shows it is alive)."""
        said, now = _ELAPSED.sub("starting", line), time.monotonic()
        if (
            self.last_printed
            and self.last_printed[0] == said
            and now - self.last_printed[1] < OFF_TERMINAL_EVERY_S
        ):
            return False
        self.last_printed = (said, now)
        return True

    def end_line(self) -> None:
        if self.line_open:  # a terminal progress line gets its newline before anything else prints
            print(flush=True)
            self.line_open = False

    def report(self, message: str) -> None:
        self.end_line()
        print(message, file=sys.stderr, flush=True)

    def show_progress(self, line: str | None) -> None:
        """Rewrite one line in place on a terminal; elsewhere (logs, CI) print each new line once."""
        if line is None or line == self.last_line:
            return
        if not sys.stdout.isatty() and not self._news(line):
            return
        self.last_line = line
        self.line_open = sys.stdout.isatty()
        print(f"\r{line}\x1b[K" if self.line_open else line, end="" if self.line_open else "\n", flush=True)
