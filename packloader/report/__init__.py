"""balance-report: figures, plots and the HTML page of `packloader report`."""
