"""StepNode's draw from its buffered stream, by `balancers.draw`'s rule: pieces in stream order until a target
number of tokens (the piece that reaches it included), continuing where the last draw ended. StepNode asks for
tokens_per_step less what its planner holds on entry, then for more while its plan runs fewer (the budget rule:
every step but the epoch's last holds tokens_per_step within one piece, delay included)."""

from __future__ import annotations

import numpy as np

from packloader.balancers.draw import step_ends


class StepDrawing:
    """`_draw` and `_draw_counted` of StepNode (its buffer `_buf_ids`/`_buf_len`/`_buf_at`, cursor `offset`,
    `_pull`, `stats`, `config`)."""

    def _draw(self, target: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
        """Documents (ids, whole lengths, first and end token drawn) until `target` tokens are drawn (within one
        piece: the step may end inside a document, at `self.offset`; none for 0) or the epoch ends; and whether
        it ended."""
        context = self.config.context
        ids, lens, starts, stops = [], [], [], []
        total = 0  # tokens drawn from earlier buffers
        while target > 0:
            if self._buf_at >= len(self._buf_ids):
                if not self._pull():
                    break
                continue
            rest = self._buf_len[self._buf_at :]
            at = self.offset
            end = step_ends(rest, target, context, steps=1, filled=total, offset=at)  # none: not a whole step here
            k, e = (int(x) for x in end[0]) if len(end) else (len(rest), 0)
            take = k + (e > 0)
            start, stop = np.zeros(take, np.int64), rest[:take].copy()
            if take:
                start[0] = at
                if e:
                    stop[-1] = e
            ids.append(self._buf_ids[self._buf_at : self._buf_at + take])
            lens.append(rest[:take])
            starts.append(start)
            stops.append(stop)
            self._buf_at += k
            self.offset = e
            if len(end):
                break
            total += int(rest.sum()) - at
        if self._buf_at >= len(self._buf_ids) and not self._last_seen:
            self._pull()  # learn whether the epoch ends here (the next chunk may be the next epoch's)
        done = self._buf_at >= len(self._buf_ids) and (self._last_seen or self._pending is not None or self._exhausted)
        if ids:
            return np.concatenate(ids), np.concatenate(lens), np.concatenate(starts), np.concatenate(stops), done
        z = np.zeros(0, np.int64)
        return z, z, z, z, done

    def _draw_counted(self, target: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
        """`_draw`, counted in the stats, empty documents left out (`_drew_any`: whether it drew any document,
        empty ones included: empty documents at an epoch's end still make its flushing step)."""
        ids, lens, starts, stops, done = self._draw(target)
        self._drew_any = len(ids) > 0
        self._masks.drawn(self._tokens, ids, starts, self.stats)  # SFT sources: their drop counts
        self.stats.documents += int((starts == 0).sum())  # documents whose first token is drawn now
        self.stats.tokens += int((stops - starts).sum())
        keep = lens > 0
        self.stats.empty_documents += int((~keep).sum())
        return ids[keep], lens[keep], starts[keep], stops[keep], done
