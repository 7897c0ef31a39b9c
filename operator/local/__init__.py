"""The local backend of `specdecode up`: a SpecDecodeDeployment's replicas as processes on this
machine, behind one ``router`` on localhost that splits requests between revisions by weight."""
