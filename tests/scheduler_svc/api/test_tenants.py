"""API keys map to tenants; the tenant bounds priority, concurrency and tokens per minute."""

import hashlib

import pytest

from pagedserve.scheduler.api.tenants import Tenants, TenantsError
from pagedserve.scheduler.engine_io import EngineError

KEYS = f"""
tenants:
  paying: {{priority: [-2, 0], max_concurrent: 2}}
  free: {{priority: [1, 2], tokens_per_minute: 600}}
keys:
  - {{key: sk-pay, tenant: paying}}
  - {{sha256: {hashlib.sha256(b"sk-free").hexdigest()}, tenant: free}}
"""


@pytest.fixture
def tenants(tmp_path):
    (tmp_path / "keys.yaml").write_text(KEYS)
    return Tenants.from_file(tmp_path / "keys.yaml")


def code(fn, *args):
    with pytest.raises(EngineError) as e:
        fn(*args)
    return e.value.code, str(e.value), e.value.retry_after_s


def test_keys_map_to_tenants_and_anything_else_is_unauthenticated(tenants):
    assert tenants.authenticate([("authorization", "Bearer sk-pay")]).name == "paying"
    assert tenants.authenticate([("x", "y"), ("authorization", "Bearer sk-free")]).name == "free"
    for metadata in ([], [("authorization", "Bearer sk-nope")], [("authorization", "sk-pay")]):
        assert code(tenants.authenticate, metadata)[0] == "UNAUTHENTICATED"


def test_the_tenant_bounds_priority(tenants):
    paying, free = tenants.by_name["paying"], tenants.by_name["free"]
    assert tenants.admit(paying, -2, 10).priority == -2
    assert tenants.admit(free, 0, 10).priority == 1  # 0: the tenant's default
    assert code(tenants.admit, free, -2, 10)[:2] == (
        "PERMISSION_DENIED", "priority -2 is outside what tenant free may ask for (1..2)")


def test_concurrency_and_tokens_per_minute(tenants):
    paying, free = tenants.by_name["paying"], tenants.by_name["free"]
    first, _ = tenants.admit(paying, 0, 5), tenants.admit(paying, 0, 5)
    assert code(tenants.admit, paying, 0, 5)[0] == "RESOURCE_EXHAUSTED"
    first.release(3)
    tenants.admit(paying, 0, 5)  # a slot is free again
    a = tenants.admit(free, 1, 400)
    a.release(150)  # 600 - 400 - 150 = 50 left, refilled at 10 a second
    status, _, retry = code(tenants.admit, free, 1, 100)
    assert status == "RESOURCE_EXHAUSTED" and 4.0 < retry <= 5.0
    assert code(tenants.admit, free, 1, 601)[0] == "RESOURCE_EXHAUSTED"  # never fits


@pytest.mark.parametrize("text", ["tenants: {a: {priority: [2, 1]}}\nkeys: [{key: k, tenant: a}]",
                                  "tenants: {a: {}}\nkeys: [{key: k, tenant: b}]",
                                  "tenants: {a: {}}\nkeys: []"])
def test_bad_files_are_refused(tmp_path, text):
    (tmp_path / "k.yaml").write_text(text)
    with pytest.raises(TenantsError):
        Tenants.from_file(tmp_path / "k.yaml")


def test_a_tenant_may_be_limited_to_its_lora_adapters(tmp_path):
    (tmp_path / "k.yaml").write_text("tenants:\n  acme: {adapters: [acme-sql]}\n  any: {}\n"
                                     "keys: [{key: k1, tenant: acme}, {key: k2, tenant: any}]")
    tenants = Tenants.from_file(tmp_path / "k.yaml")
    acme, anyone = tenants.by_name["acme"], tenants.by_name["any"]
    assert acme.may_use("acme-sql") and acme.may_use("")  # its adapter, and the base
    assert anyone.may_use("other")
    acme.check_adapter("acme-sql")
    assert code(acme.check_adapter, "other")[:2] == (
        "PERMISSION_DENIED", "tenant acme may not use LoRA adapter 'other' (its adapters: "
        "acme-sql)")
    (tmp_path / "k.yaml").write_text("tenants: {a: {adapters: x}}\nkeys: [{key: k, tenant: a}]")
    with pytest.raises(TenantsError, match="adapters must be a list"):
        Tenants.from_file(tmp_path / "k.yaml")


def test_admin_tenants_are_named_in_the_file(tmp_path):
    (tmp_path / "k.yaml").write_text("tenants: {ops: {admin: true}, user: {}}\n"
                                     "keys: [{key: k1, tenant: ops}, {key: k2, tenant: user}]")
    tenants = Tenants.from_file(tmp_path / "k.yaml")
    assert (tenants.by_name["ops"].admin, tenants.by_name["user"].admin) == (True, False)
    (tmp_path / "k.yaml").write_text("tenants: {a: {admin: yes please}}\n"
                                     "keys: [{key: k, tenant: a}]")
    with pytest.raises(TenantsError, match="admin must be true or false"):
        Tenants.from_file(tmp_path / "k.yaml")
