"""Results directories, figures and the HTML report."""
