"""Helpers of the test suite that are not tests: what the suite's processes and their children share."""
