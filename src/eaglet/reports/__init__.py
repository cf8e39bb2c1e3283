"""What reads the build graph: status, the whole run planned (plan, placement), two pipeline
versions compared, a run published, its report.
"""
