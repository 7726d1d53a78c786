"""Research code around the package: launching (launch/), statistics (stats/) and one folder per study (studies/)."""
