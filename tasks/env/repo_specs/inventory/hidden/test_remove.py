import pytest
from inventory import Inventory


def _inv():
    inv = Inventory()
    inv.add("cup", 4, price=3)
    return inv


def test_remove_some():
    inv = _inv()
    inv.remove("cup", 1)
    assert inv.quantity("cup") == 3


def test_remove_all_forgets_item():
    inv = _inv()
    inv.remove("cup", 4)
    assert inv.quantity("cup") == 0 and len(inv) == 0 and inv.names() == []
    with pytest.raises(KeyError):
        inv.price("cup")


def test_remove_unknown():
    with pytest.raises(KeyError):
        _inv().remove("plate", 1)


def test_remove_too_many_or_bad():
    inv = _inv()
    with pytest.raises(ValueError):
        inv.remove("cup", 5)
    with pytest.raises(ValueError):
        inv.remove("cup", 0)
    assert inv.quantity("cup") == 4
