"""A value from a benchmark's own kernel (jupyter_client): one helper for every bench."""

from __future__ import annotations


def kernel_value(kc, expr: str, timeout: float = 60):
    """``expr`` evaluated in the kernel, read back from its printed repr; the cell's
    shell reply is consumed too (older replies left unread are skipped)."""
    msg_id = kc.execute(f"print(repr({expr}))")
    out = ""
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out += msg["content"]["text"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while kc.get_shell_msg(timeout=timeout)["parent_header"].get("msg_id") != msg_id:
        pass
    return eval(out)  # our own repr of plain values, from our own kernel
