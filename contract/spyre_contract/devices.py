"""The cards a pod was given, as the Spyre device plugin says: it sets `PCIDEVICE_IBM_COM_<RESOURCE>` (for
`ibm.com/spyre_pf`: `PCIDEVICE_IBM_COM_SPYRE_PF`; tier and VF resources and the older `ibm.com/aiu_pf` alike)
to the comma list of the PCI addresses it allocated to the container."""

from __future__ import annotations

import re
from collections.abc import Mapping

from spyre_contract.environment import ContractError

DEVICE_PLUGIN_PREFIX = "PCIDEVICE_IBM_COM_"
PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def allocated_cards(environ: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Each device plugin variable and the PCI addresses it names; a malformed address is a ContractError."""
    cards = {}
    for name in sorted(environ):
        if not name.startswith(DEVICE_PLUGIN_PREFIX):
            continue
        addresses = tuple(a.strip() for a in environ[name].split(",") if a.strip())
        for a in addresses:
            if not PCI_ADDRESS.match(a):
                raise ContractError(f"{name}={environ[name]!r}: {a!r} is not a PCI address (dddd:bb:dd.f)")
        cards[name] = addresses
    return cards


def describe_cards(environ: Mapping[str, str], tensor_parallel_size: int, backend: str) -> str:
    """The start-up line naming the cards the device plugin gave; on Spyre (`sendnn`) fewer cards than
    --tensor-parallel-size stop start-up. CPU backends use no card and only say what they were given."""
    cards = allocated_cards(environ)
    total = sum(len(a) for a in cards.values())
    if not cards:
        if backend == "sendnn":
            return "no device plugin variable (PCIDEVICE_IBM_COM_*): the cards are not named to this pod"
        return f"no cards: the {backend} backend runs on the CPU"
    named = "; ".join(f"{name}={','.join(a)}" for name, a in cards.items())
    if backend == "sendnn" and total < tensor_parallel_size:
        raise ContractError(
            f"--tensor-parallel-size={tensor_parallel_size} needs {tensor_parallel_size} cards; the device "
            f"plugin gave this pod {total} ({named})"
        )
    where = "for the tensor-parallel workers" if backend == "sendnn" else f"unused by the {backend} backend"
    return f"{total} card(s) from the device plugin, {where}: {named}"
