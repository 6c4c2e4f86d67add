"""OpenVINO: partitions compiled by Intel's OpenVINO for the CPU (see ``backend.py``)."""
