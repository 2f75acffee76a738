"""Commands around training: plan (memory), bench (speed), report (HTML), doctor (cluster checks)."""
