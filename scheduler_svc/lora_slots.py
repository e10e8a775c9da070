"""Which LoRA adapter each of the executor's device slots holds (--max-loras of them), decided
here as block placement is: the executor loads an adapter into a slot when a plan says so
(StepPlan.lora_loads) and applies each request's slot to its rows.

A slot is held while a request running on it is on the executor; a slot nobody holds may be
given to another adapter, least recently used first. An adapter already in a slot is reused
without a load. Slot ids are 1..max_loras (0 is the base model).
"""

from __future__ import annotations

from collections import OrderedDict


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._adapter = [0] * (max_loras + 1)  # slot -> adapter id (0: empty)
        self._users = [0] * (max_loras + 1)  # slot -> requests holding it
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, max_loras + 1))
        self._loads: list[tuple[int, int]] = []  # (slot, adapter id) for the next plan
        self.num_loads = 0

    def can_take(self, adapter_id: int) -> bool:
        """Whether a request of this adapter could get a slot now."""
        return self._resident(adapter_id) is not None or self._free_slot() is not None

    def take(self, adapter_id: int) -> int:
        """A slot holding adapter_id for one more request (loading it if need be); the caller
        has checked can_take."""
        slot = self._resident(adapter_id)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "take() without can_take()"
            self._adapter[slot] = adapter_id
            self._loads.append((slot, adapter_id))
            self.num_loads += 1
        self._users[slot] += 1
        self._lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        """A request holding slot left the executor (finished, aborted or preempted)."""
        assert self._users[slot] > 0, f"LoRA slot {slot} released more often than taken"
        self._users[slot] -= 1

    def forget(self, adapter_id: int) -> None:
        """An adapter unloaded (no request holds its slot): its slot is empty again."""
        for slot in range(1, self.max_loras + 1):
            if self._adapter[slot] == adapter_id:
                assert not self._users[slot], "an adapter forgotten while its slot is held"
                self._adapter[slot] = 0

    def invalidate(self, loads: list[tuple[int, int]]) -> None:
        """The step that carried these loads failed: the executor may hold none of them, so
        their slots count as empty (a request of the adapter loads it again)."""
        for slot, adapter_id in loads:
            if self._adapter[slot] == adapter_id:
                self._adapter[slot] = 0

    def take_loads(self) -> list[tuple[int, int]]:
        """The loads the next plan carries, in order."""
        loads, self._loads = self._loads, []
        return loads

    def reset(self) -> None:
        """A new executor: it holds nothing (every request was preempted first)."""
        assert not any(self._users), "LoRA slots reset while held"
        self._adapter = [0] * (self.max_loras + 1)
        self._loads = []

    def residents(self) -> dict[int, int]:
        """Adapter id -> slot, of the slots holding one."""
        return {a: s for s, a in enumerate(self._adapter) if a}

    def in_use(self) -> set[int]:
        """Adapter ids of the slots some request holds."""
        return {self._adapter[s] for s in range(1, self.max_loras + 1) if self._users[s]}

    def _resident(self, adapter_id: int) -> int | None:
        for slot in range(1, self.max_loras + 1):
            if self._adapter[slot] == adapter_id:
                return slot
        return None

    def _free_slot(self) -> int | None:
        for slot in self._lru:  # least recently used first
            if not self._users[slot]:
                return slot
        return None
