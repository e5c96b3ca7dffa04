"""Device objects: GPU tensors handed between processes and GPUs without touching host memory.

* :mod:`~kvstrata.devobj.broker`: the registry and meeting point, hosted in the worker.
* :mod:`~kvstrata.devobj.api`: the client side (:class:`DeviceObjects`, the ``dev_*`` methods).
* :mod:`~kvstrata.devobj.ipc`: the same-node data path (CUDA IPC, peer copies over NVLink/PCIe).
* :mod:`~kvstrata.devobj.nccl`: the between-nodes data path (NCCL send/recv per pair).
"""

from kvstrata.devobj.api import BrokerLink, DeviceObjectConfig, DeviceObjects, InprocBrokerLink
from kvstrata.devobj.broker import DeviceBroker

__all__ = ["BrokerLink", "DeviceBroker", "DeviceObjectConfig", "DeviceObjects", "InprocBrokerLink"]
