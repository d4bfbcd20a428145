class Inventory:
    def __init__(self):
        self._qty = {}
        self._price = {}

    @staticmethod
    def _check_quantity(quantity):
        if isinstance(quantity, bool) or not isinstance(quantity, int) or quantity <= 0:
            raise ValueError("quantity must be a positive int")

    def add(self, name, quantity, price=None):
        self._check_quantity(quantity)
        if price is None and name not in self._price:
            raise ValueError(f"a price is needed for the new item {name!r}")
        if price is not None:
            if price < 0:
                raise ValueError("price must not be negative")
            self._price[name] = price
        self._qty[name] = self._qty.get(name, 0) + quantity

    def remove(self, name, quantity):
        if name not in self._qty:
            raise KeyError(name)
        self._check_quantity(quantity)
        if quantity > self._qty[name]:
            raise ValueError("not enough in stock")
        self._qty[name] -= quantity
        if self._qty[name] == 0:
            del self._qty[name]
            del self._price[name]

    def quantity(self, name):
        return self._qty.get(name, 0)

    def price(self, name):
        return self._price[name]

    def total_value(self):
        return sum(q * self._price[n] for n, q in self._qty.items())

    def names(self):
        return sorted(self._qty)

    def __len__(self):
        return len(self._qty)
