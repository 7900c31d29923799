"""Values: a step's batch and shape, the declared inputs, the decode loop's values, the reports, the seams."""
