"""The BE queue service (`tandem queue`): batch jobs in a database, released under flow control."""
