"""The outer search: the request and the configurations it spans, lower bounds, each degree's view of the profile, the
simulator as judge, and why a request has no answer."""
