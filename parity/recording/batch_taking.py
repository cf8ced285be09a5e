"""Rank 0's side of a recorded step's batch (parity/recording/recorder.py): the global batch from every DP rank's
rows — its hash, the rows check, its shape in the record — saved for the replay by the background writer (rows.py),
and the writes it finished counted; a post-training objective's rows, loss and quantities, and its rollout file at
the end (recorded_objective.py). What cannot be taken or saved stops the record at that step."""

from __future__ import annotations

import torch

from parity import storage
from parity.errors import first_line
from parity.recording.rows import duplicate_rows, global_batch, positions_line, row_digests, rows_hash
from parity.training.data import Batch, batch_hash, recorded_batch_path


class BatchTaking:
    """The recorder's batch methods (a mixin of ParityRecorder: its record, writer, folder, step and stop)."""

    def _take_batch(self, got, extras: dict) -> str:
        """Rank 0: the step's global batch from every DP rank's rows — its hash, the rows check, its shape (into the
        step's `extras`) — saved for the replay. A batch that cannot be taken stops the record at this step. Returns
        the batch's hash ("" where it could not be taken)."""
        config = self.record.data["config"]
        try:
            self._harvest(self.writer.finished())
            batch, mask, structure = global_batch(got.per_dp_rank)
            digests = row_digests(got.per_dp_rank)
            extras["rows_hash"] = rows_hash(digests)
            if self.objective_rows is None or self.objective_rows.family != "grpo":  # sampled rows may repeat
                extras["rows_check"] = duplicate_rows(digests)
            extras["rows"], extras["micro_batches"] = len(batch.input_ids), structure
            if batch.fed is not None and config["batches"]["position_ids_from"] is None:
                config["batches"]["position_ids_from"] = self.step
                self._line(positions_line(self.step, batch.fed))
            self._shape(structure, batch)
            self._save_batch(batch, mask)
            return batch_hash(batch)
        except ValueError as exc:  # rows the replay cannot feed (rows.padding_problem)
            self._stop_at(self.step, f"step {self.step}: {first_line(exc)}")
        except Exception as exc:
            self._stop_at(self.step, f"step {self.step}'s batch could not be hashed or saved ({type(exc).__name__}: "
                                     f"{first_line(exc)})")
        return ""

    def _shape(self, structure: list[list[int]], batch: Batch) -> None:
        """The run's batch shape so far, in the record's config: step 0's rows per DP rank and micro-batches (shown as
        the run's batch size and accumulation), the most rows any micro-batch held (the replay's micro-batches hold no
        more), the longest row. Every step's own shape is in its entry: it may differ from step to step and rank to
        rank."""
        config = self.record.data["config"]
        if config["batch_size"] is None:
            config["batch_size"] = max(map(sum, structure))
            config["global_batch_size"] = sum(map(sum, structure))
            config["grad_accum_steps"] = max(map(len, structure))
        layout = config["batches"]
        layout["most_rows"] = max(layout["most_rows"], *(n for rank in structure for n in rank))
        config["seq_length"] = max(config["seq_length"] or 0, batch.input_ids.shape[1])

    def _save_batch(self, batch: Batch, mask: torch.Tensor) -> None:
        if self.stop is not None or self.objective_rows is not None:  # (an objective's rows go to its rollout file)
            return
        size = (3 if batch.fed is None else 4) * batch.input_ids.numel() * 8  # int64 ids, labels, mask (positions)
        if self.saved_bytes + size > self.max_batch_bytes:
            self._stop_at(self.step, f"the batches passed max_batch_bytes ({self.max_batch_bytes} bytes) at step "
                                     f"{self.step}: no more are saved")
            return
        fed = {} if batch.fed is None else {"position_ids": batch.position_ids, "fed": batch.fed}
        self.writer.submit(self.step, recorded_batch_path(storage.join(self.folder, "batches"), self.step),
                           {"input_ids": batch.input_ids, "labels": batch.labels, "attention_mask": mask, **fed})
        self.saved_bytes += size

    def _harvest(self, finished: list[tuple[int, str | None]]) -> None:
        """The batches the writer has finished: saved_steps counts those on disk, in order; one that failed stops the
        record at its step."""
        layout = self.record.data["config"]["batches"]
        for step, failed in finished:
            if failed:
                self._stop_at(step, f"step {step}'s batch could not be saved ({failed})")
            elif step == layout["saved_steps"]:
                layout["saved_steps"] = step + 1

    def _objective_step(self, got, measured: dict) -> dict:
        """Rank 0: a post-training objective's step — its loss under the reference objective, its tokens and
        quantities (RecordedObjective.step) — or, for the causal LM, `measured`. Rows the replay cannot take, or past
        max_batch_bytes, stop the record at this step."""
        if self.objective_rows is None or self.stop is not None:
            return measured
        try:
            found = self.objective_rows.step(self.step, got.per_dp_rank)
        except ValueError as exc:  # rows the replay cannot take
            self._stop_at(self.step, first_line(exc))
            return measured
        except Exception as exc:  # rank 0 alone: never the other ranks left in a collective
            self._stop_at(self.step, f"step {self.step}'s rollouts could not be taken ({type(exc).__name__}: "
                                     f"{first_line(exc)})")
            return measured
        if self.objective_rows.saved_bytes > self.max_batch_bytes:
            self._stop_at(self.step, f"the rollouts passed max_batch_bytes ({self.max_batch_bytes} bytes) at step "
                                     f"{self.step}: no more are kept")
        return found

    def _objective_file(self, final: bool = True) -> None:
        """Rank 0, where the record is written whole: a post-training objective's rollout file of the steps recorded,
        each step's hash, tokens and loss as its replay computes them (RecordedObjective.finish); at the end (`final`)
        without a last generation batch it does not hold whole (whole_generations)."""
        if self.objective_rows is not None:
            keep, why = self.objective_rows.whole_generations(len(self.record.data["steps"])) if final else (0, None)
            if why:
                self._stop_at(keep, why)
                self._apply_stop()
            config = self.record.data["config"]
            path = self.objective_rows.finish(self.folder, self.record.data["steps"], f"{config['framework']}")
            config["rollouts"] = f"recorded_{self.name}/{storage.name(path)}" if path else None
            config["batches"]["saved_steps"] = len(self.record.data["steps"])
