"""`packloader report` as a library: what a data set's lengths do to a parallel layout under each strategy."""

from packloader.report.build import ReportOptions, build_report
from packloader.report.draw import Draw, draw_steps
from packloader.report.figures import Report
from packloader.report.lengths import Lengths, LengthsError, read_lengths, source_lengths

__all__ = ["Draw", "Lengths", "LengthsError", "Report", "ReportOptions", "build_report", "draw_steps", "read_lengths", "source_lengths"]
