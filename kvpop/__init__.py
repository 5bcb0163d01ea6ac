"""kvpop"""
