"""What rank 0 shows of a reinforcement-learning run (the actor-learner strategy): a progress bar
towards the target return on a terminal (plain lines elsewhere), a metrics row per `rl.log_every`
learner updates, and the summary table's rows of environment steps, returns and policy lag."""

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from gradmesh.monitor.progress import LiveBar

LINE_EVERY_S = 5.0


class ReturnProgress(LiveBar):
    """The mean return of the last 100 episodes against the target; silent when not `enabled`."""

    def __init__(self, target: float, enabled: bool = True, console: Console | None = None):
        self.target, self.enabled = target, enabled
        self.console = console or Console()
        self._bar: Progress | None = None
        self._next_line = time.perf_counter() + LINE_EVERY_S
        if enabled and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]return"),
                BarColumn(),
                TextColumn("{task.fields[mean]} / {task.total:.0f}"),
                TextColumn("{task.fields[rate]} env steps/s"),
                TextColumn("lag {task.fields[lag]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task("return", total=target, mean="-", rate="-", lag="-")
            self._bar.start()

    def update(self, row: dict) -> None:
        if not self.enabled:
            return
        mean = row.get("episode_return")
        shown = "-" if mean is None else f"{mean:.1f}"
        lag = row.get("staleness_mean")
        if self._bar is not None:
            rate, lag_text = f"{row['env_steps_per_s']:,.0f}", "-" if lag is None else f"{lag:.2f}"
            self._bar.update(self._task, completed=min(mean or 0.0, self.target), mean=shown, rate=rate, lag=lag_text)
        elif time.perf_counter() >= self._next_line:
            self._next_line = time.perf_counter() + LINE_EVERY_S
            print(
                f"update {row['step']}  return {shown} (last 100)  {row['env_steps']:,} env steps  "
                f"{row['env_steps_per_s']:,.0f} env steps/s  policy lag {lag if lag is None else round(lag, 2)}",
                flush=True,
            )


def summary_rows(rl: dict) -> list[tuple[str, str]]:
    """The summary table's rows for a reinforcement-learning run's `rl` figures."""
    reached = rl.get("target_reached_s")
    mean = rl.get("episode_return")
    per_actor = ", ".join(f"{rate:,.0f}" for rate in rl["actor_env_steps_per_s"])
    counts = rl["trajectories"]
    rows = [
        ("learners, actors", f"{rl['learners']}, {rl['actors']}"),
        ("environment steps", f"{rl['env_steps']:,}"),
        ("env steps/s (all; per actor)", f"{rl['env_steps_per_s']:,.0f}; {per_actor}"),
        ("episode return (last 100)", "-" if mean is None else f"{mean:.1f} over {rl['episodes']:,} episodes"),
        (
            f"time to return >= {rl['target_return']:g}",
            "not reached" if reached is None else f"{reached:.1f} s, {rl['target_reached_env_steps']:,} env steps",
        ),
        ("policy lag (max, mean)", f"{rl['policy_lag']['max']} versions, {rl['policy_lag']['mean']:.2f}"),
        ("trajectories sent, applied", f"{sum(counts['sent']):,}, {sum(counts['applied']):,}"),
    ]
    if rl.get("lost_actors"):
        rows.append(("actors lost", ", ".join(f"rank {rank}" for rank in rl["lost_actors"])))
    return rows
