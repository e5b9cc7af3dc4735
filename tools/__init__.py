"""Tools the tests run that are not tests themselves: the ahead-of-time compile gate (``compile_gate.py``), the
public API's fuzz harness (``fuzz_api.py``), the Triton driver that compiles without a GPU (``stand_in_driver.py``,
bench's too), and the helpers that spawn CPU distributed ranks (``distributed.py``) and run verl's engines on the CPU
(``verl_cpu.py``). Each script runs from the checkout's root:
``python tools/compile_gate.py --arch 90``."""
