"""tracker"""
