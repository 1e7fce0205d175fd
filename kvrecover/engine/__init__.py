"""Engine side: requests, the block pool, the scheduler, recovery and the step loop."""
