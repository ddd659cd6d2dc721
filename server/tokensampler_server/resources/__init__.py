"""What outlives a call: registered weights, regions, and the leases that keep them alive while a call uses
them. Imports core only."""
